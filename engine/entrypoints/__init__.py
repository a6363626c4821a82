"""Ways in: LLM (offline batches, llm.py) and PDCluster (prefill and decode processes behind a router, pd_cluster.py)."""
