"""Sampling: the vLLM-order sampler (sampler.py) and exact rejection sampling of draft tokens (rejection_sampler.py)."""
