"""Model loading (registry, GGUF conversion), the Llama-family model, the runner and the sampler."""

from engine.model.loader import resolve_model

__all__ = ["resolve_model"]
