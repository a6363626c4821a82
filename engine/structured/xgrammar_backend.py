"""xgrammar as the guided-decoding backend: compile a request's constraint, then match tokens against it."""
from __future__ import annotations

import json
import re

import numpy as np
import torch
import xgrammar as xgr

from engine.request import StructuredOutputsParams

def grammar_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """A hashable (kind, spec) that identifies the compiled grammar: the compile cache's key."""
    if params.json is not None:
        schema = params.json
        if isinstance(schema, type):  # a pydantic model class
            schema = schema.model_json_schema()
        if isinstance(schema, dict):
            schema = json.dumps(schema)  # key order matters: the grammar emits properties in it
        return "json", schema
    if params.json_object:
        return "json_object", ""
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        return "choice", json.dumps(params.choice)
    return "grammar", params.grammar


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly the given strings."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class XgrammarBackend:
    """Owns xgrammar's TokenizerInfo (built once per model) and its GrammarCompiler."""

    def __init__(self, tokenizer, vocab_size: int, max_threads: int = 2) -> None:
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)

    def compile(self, key: tuple[str, str]) -> xgr.CompiledGrammar:
        kind, spec = key
        if kind == "json":
            # compact separators: a small model at high temperature can otherwise loop on whitespace
            return self.compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "json_object":
            return self.compiler.compile_builtin_json_grammar()
        if kind == "regex":
            re.compile(spec)  # a clear Python error for a malformed pattern
            return self.compiler.compile_regex(spec)
        if kind == "choice":
            return self.compiler.compile_grammar(choice_grammar(json.loads(spec)))
        return self.compiler.compile_grammar(spec)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)


class Grammar:
    """One request's grammar state: an xgrammar matcher over its compiled grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)  # rollback depth is unlimited in xgrammar 0.2

    def accept_token(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> int:
        """Write the allowed tokens into bitmask[row]; return how many are allowed."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        return int(np.unpackbits(bitmask[row].numpy().view(np.uint8)).sum())

    def jump_forward_string(self) -> str:
        return self.matcher.find_jump_forward_string()

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set disallowed logits to -inf, in place, on the given rows (bitmask rows in the same order)."""
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
