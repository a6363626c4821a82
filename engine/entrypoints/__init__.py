"""Ways in: LLM (offline batches, llm.py), PDCluster (prefill and decode processes behind a router, pd_cluster.py)
and DPLBClient (data-parallel replicas behind a load balancer, dp_client.py)."""
