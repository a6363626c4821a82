"""Block pool, KV cache manager, block hashes, request queues and the scheduler."""
