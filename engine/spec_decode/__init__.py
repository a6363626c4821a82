"""Speculative decoding: proposers (n-gram, draft model), verification by rejection sampling, metrics."""
