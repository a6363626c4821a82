"""xgrammar as the guided-decoding backend: compile a request's constraint, then match tokens against it."""

from __future__ import annotations

import functools
import json
import re
from typing import Any, cast

import numpy as np
import torch

try:
    import xgrammar as xgr
    from jsonschema import SchemaError
    from jsonschema.validators import Draft202012Validator, validator_for
except ImportError as exc:  # imported at the first guided request only (manager.xgrammar_backend)
    raise ImportError(
        f"structured_outputs: guided decoding needs xgrammar and jsonschema ({exc}); install them "
        "with `pip install xgrammar==0.2.9 jsonschema`"
    ) from exc

from engine.sampling_params import StructuredOutputsParams


def grammar_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """A hashable (kind, spec) that identifies the compiled grammar: the compile cache's key."""
    if params.json is not None:
        schema = params.json
        if isinstance(schema, type):  # a pydantic model class
            schema = cast(Any, schema).model_json_schema()
        if isinstance(schema, dict):
            schema = json.dumps(schema)  # key order matters: the grammar emits properties in it
        return "json", schema
    if params.json_object:
        return "json_object", ""
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        return "choice", json.dumps(params.choice)
    if params.grammar is None:  # StructuredOutputsParams requires exactly one kind
        raise ValueError("structured_outputs: one of json, json_object, regex, choice or grammar is required")
    return "grammar", params.grammar


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly the given strings."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


_KIND_NAMES = {"json": "JSON schema", "regex": "regular expression", "choice": "choice", "grammar": "EBNF grammar"}


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """Check a request's constraint at add_request, as vLLM does, without a tokenizer: parse it with xgrammar's
    tokenizer-free constructors (the front end the compile runs later) and check a JSON schema against its
    metaschema too (xgrammar accepts some invalid schemas, e.g. {"minLength": -1}). Raises ValueError (TypeError
    for a wrong type) naming the field and carrying the library's own message; compiling stays asynchronous."""
    for name in ("regex", "grammar"):
        if getattr(params, name) is not None and not isinstance(getattr(params, name), str):
            raise TypeError(f"structured_outputs.{name}: expected str, got {type(getattr(params, name)).__name__}")
    if (
        params.json is not None
        and not isinstance(params.json, (dict, str))
        and not (isinstance(params.json, type) and hasattr(params.json, "model_json_schema"))
    ):
        raise TypeError(
            f"structured_outputs.json: expected a dict, a JSON string or a pydantic model class, got {params.json!r}"
        )
    _validate_key(*grammar_key(params))


@functools.lru_cache(maxsize=256)  # the metaschema check costs ~1.5 ms a schema: pay it once per distinct one
def _validate_key(kind: str, spec: str) -> None:
    field = f"structured_outputs.{kind}"
    if kind == "json":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field}: not valid JSON ({exc})") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{field}: invalid JSON schema: must be an object or a boolean, got {spec[:80]}")
        try:
            validator_for(schema, default=Draft202012Validator).check_schema(schema)
        except SchemaError as exc:
            raise ValueError(f"{field}: invalid JSON schema at {exc.json_path}: {exc.message}") from None
    try:
        if kind == "json":  # the compile's options: a schema xgrammar cannot convert fails here, not later
            xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind in ("choice", "grammar"):
            xgr.Grammar.from_ebnf(choice_grammar(json.loads(spec)) if kind == "choice" else spec)
    except RuntimeError as exc:  # xgrammar's errors read "[time] file.cc:line: message"
        message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())
        raise ValueError(f"{field}: invalid {_KIND_NAMES[kind]}: {message}") from None


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
        if kind == "regex":  # xgrammar's syntax, not Python's: validate_structured_outputs checked it
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
