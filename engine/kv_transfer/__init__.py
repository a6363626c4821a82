"""KV transfer between engine instances (disaggregated prefill/decode), as vLLM V1's KV connectors."""
from engine.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVLoadError, ReqMeta
from engine.kv_transfer.factory import create_connector

__all__ = ["KVConnectorBase", "KVConnectorMetadata", "KVLoadError", "ReqMeta", "create_connector", "PDCluster"]


def __getattr__(name: str):
    if name == "PDCluster":  # multiprocessing machinery: loaded only when asked for
        from engine.kv_transfer.pd import PDCluster
        return PDCluster
    raise AttributeError(name)
