"""Reference outputs from Hugging Face transformers on the same weights, cached per process."""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.lru_cache(maxsize=4)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=64)
def _greedy_one(path: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model = hf_model(path)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=model.generation_config.eos_token_id,
        )
    return tuple(out[0, len(prompt) :].tolist())


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate`, one prompt at a time (no padding), stopping at EOS like ours."""
    return [list(_greedy_one(str(path), tuple(p), max_new_tokens)) for p in prompts]
