"""Speculative decoding: proposers (n-gram, draft model) behind one interface (proposer.py), chosen by
speculative_config.method from decoder.PROPOSERS; verification by rejection sampling; metrics."""
