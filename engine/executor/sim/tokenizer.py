"""A tokenizer for a simulated model that ships none (a built-in config): text is UTF-8 bytes, one id each (ids
0-255); any other id, such as the simulated executor's random tokens, reads as `[id]`. Enough to add text prompts,
see output lengths and follow a request in the views; the model's real tokenizer is used wherever its folder has one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.executor.sim.model_spec import ModelSpec


class ByteTokenizer:
    """Owns the byte <-> id mapping of a model without a tokenizer, over the model's vocabulary size, with the
    few attributes the engine and the benchmarks read of a Hugging Face tokenizer."""

    all_special_ids: list[int] = []
    added_tokens_decoder: dict[int, object] = {}
    chat_template = None

    def __init__(self, vocab_size: int, eos_token_id: int | None = None) -> None:
        if vocab_size < 256:
            raise ValueError(f"vocab_size: a byte tokenizer needs at least 256 ids, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        out, run = [], bytearray()
        for t in token_ids:
            if t < 256:
                run.append(t)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
            out.append(f"[{t}]")
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


def spec_tokenizer(spec: ModelSpec) -> Any:
    """A simulated model's tokenizer: the one beside its config.json where there is one, else bytes over its
    vocabulary (benchmarks sample their workloads with it before any engine exists)."""
    folder = spec.folder
    if folder is not None and any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer  # heavy: only for a model that ships a tokenizer

        return AutoTokenizer.from_pretrained(folder)
    eos = spec.eos_token_id[0] if isinstance(spec.eos_token_id, list) else spec.eos_token_id
    return ByteTokenizer(spec.vocab_size, eos)
