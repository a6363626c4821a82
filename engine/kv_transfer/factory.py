"""KVConnectorFactory: the connector named by `kv_transfer_config["kv_connector"]`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.events import EventLog
from engine.kv_transfer.base import KVConnectorBase

if TYPE_CHECKING:
    from engine.config import EngineConfig


def create_connector(
    config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int, events: EventLog
) -> KVConnectorBase:
    """Build the configured connector (imported on demand: redis is needed only by the Redis one)."""
    if config.kv_transfer is None:
        raise ValueError("kv_transfer_config: required for a connector")
    if config.kv_transfer.kv_connector == "ExampleConnector":
        from engine.kv_transfer.shared_storage import ExampleConnector

        return ExampleConnector(config, num_layers, num_kv_heads, head_dim, events)
    from engine.kv_transfer.redis_connector import RedisConnector

    return RedisConnector(config, num_layers, num_kv_heads, head_dim, events)
