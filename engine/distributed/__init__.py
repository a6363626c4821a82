"""torch.distributed for the engine: the tensor-parallel group of a worker process (parallel_state)."""
