"""Between processes and machines: torch.distributed for the engine (the tensor-parallel group of a worker process,
parallel_state; several nodes, nodes and launch), and vLLM's KV cache events over ZeroMQ (kv_events)."""
