"""KV transfer between engine instances (disaggregated prefill/decode), as vLLM V1's KV connectors: the interface
(base.py), the connectors, and the factory that picks one by name. PDCluster, which runs instances in
processes behind a router, is an entrypoint: engine.entrypoints.pd_cluster."""
