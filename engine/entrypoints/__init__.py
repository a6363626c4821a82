"""Ways in: LLM (offline batches, llm.py), PDCluster (prefill and decode processes behind a router, pd_cluster.py)
and DPLBClient (data-parallel replicas behind a load balancer, dp_client.py). The last two share core.py (an engine
in its own process) and core_client.py (the router that talks to those processes)."""
