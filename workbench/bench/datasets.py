"""Seeded synthetic workloads, made locally (nothing downloaded): random token-id prompts (vLLM's `random` and
`prefix_repetition`), JSON-schema requests for guided decoding, and input-grounded editing prompts whose answers
repeat spans of their input (the case speculative decoding is for)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: its prompt token ids and how many tokens it generates: exactly `output_len` when
    `ignore_eos`, else at most (it may stop at EOS, or when its `json_schema` is complete)."""

    prompt_token_ids: list[int]
    output_len: int
    ignore_eos: bool = True
    json_schema: dict[str, Any] | None = None


def token_id_range(tokenizer) -> tuple[int, int]:
    """[low, high) of ordinary token ids: above every special and added token, below the vocabulary size.

    Random ids drawn from here look like text to the model, never like a chat marker or an end of sequence."""
    low = max([*tokenizer.all_special_ids, *tokenizer.added_tokens_decoder], default=-1) + 1
    return low, len(tokenizer)


def random_requests(
    num_requests: int,
    input_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
    token_range: tuple[int, int],
    seed: int = 0,
) -> list[BenchRequest]:
    """`num_requests` prompts of uniform random length and token ids, each with a uniform random output length
    (ranges inclusive). The same arguments always give the same requests."""
    _check_range("input_len_range", input_len_range)
    _check_range("output_len_range", output_len_range)
    rng = random.Random(seed)
    low, high = token_range
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(*input_len_range)
        requests.append(
            BenchRequest([rng.randrange(low, high) for _ in range(prompt_len)], rng.randint(*output_len_range))
        )
    return requests


def shared_prefix_requests(
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    num_requests: int,
    output_len: int,
    token_range: tuple[int, int],
    seed: int = 0,
) -> list[BenchRequest]:
    """`num_requests` prompts, each one of `num_prefixes` random shared prefixes (round robin, so every prefix
    is reused equally) followed by its own random suffix: the system-prompt / few-shot pattern prefix caching
    is for."""
    if num_prefixes < 1 or prefix_len < 0 or suffix_len < 1:
        raise ValueError(
            f"num_prefixes >= 1, prefix_len >= 0, suffix_len >= 1 expected, got "
            f"{num_prefixes}, {prefix_len}, {suffix_len}"
        )
    rng = random.Random(seed)
    low, high = token_range
    prefixes = [[rng.randrange(low, high) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        BenchRequest(prefixes[i % num_prefixes] + [rng.randrange(low, high) for _ in range(suffix_len)], output_len)
        for i in range(num_requests)
    ]


def _check_range(name: str, bounds: tuple[int, int]) -> None:
    lo, hi = bounds
    if not 1 <= lo <= hi:
        raise ValueError(f"{name}: expected 1 <= low <= high, got {lo} {hi}")


def len_range(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's `--random-range-ratio`: lengths uniform in [floor(L * (1 - r)), ceil(L * (1 + r))], r in [0, 1)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio: must be in [0, 1), got {range_ratio}")
    if length < 1:
        raise ValueError(f"length: must be >= 1, got {length}")
    return max(1, math.floor(length * (1 - range_ratio))), math.ceil(length * (1 + range_ratio))


def random_dataset(
    num_requests: int, input_len: int, output_len: int, range_ratio: float, token_range: tuple[int, int], seed: int = 0
) -> list[BenchRequest]:
    """vLLM's `random` dataset: random token ids, input and output lengths spread by `range_ratio` around
    `input_len` and `output_len`; every request generates exactly its output length."""
    return random_requests(
        num_requests, len_range(input_len, range_ratio), len_range(output_len, range_ratio), token_range, seed
    )


def prefix_repetition_requests(
    num_requests: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    token_range: tuple[int, int],
    seed: int = 0,
) -> list[BenchRequest]:
    """vLLM's `prefix_repetition` dataset: `num_prefixes` random prefixes, each repeated over an equal share of
    the requests (the first `num_requests % num_prefixes` prefixes get one more, so exactly `num_requests` come
    out), each with its own random suffix; then shuffled, so a prefix's requests arrive spread out."""
    if not 1 <= num_prefixes <= num_requests or prefix_len < 0 or suffix_len < 1 or output_len < 1:
        raise ValueError(
            f"prefix_repetition: expected 1 <= num_prefixes <= num_requests, prefix_len >= 0, "
            f"suffix_len >= 1, output_len >= 1; got num_prefixes={num_prefixes}, num_requests="
            f"{num_requests}, prefix_len={prefix_len}, suffix_len={suffix_len}, output_len={output_len}"
        )
    rng = random.Random(seed)
    low, high = token_range
    requests = []
    for j in range(num_prefixes):
        prefix = [rng.randrange(low, high) for _ in range(prefix_len)]
        share = num_requests // num_prefixes + (j < num_requests % num_prefixes)
        requests += [
            BenchRequest(prefix + [rng.randrange(low, high) for _ in range(suffix_len)], output_len)
            for _ in range(share)
        ]
    rng.shuffle(requests)
    return requests


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """`text` as one user turn through the tokenizer's chat template (plain encoding without one)."""
    if getattr(tokenizer, "chat_template", None):
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return tokenizer.encode(text, add_special_tokens=False)


_STR = {"type": "string", "maxLength": 24}
_LIST = {"type": "array", "items": _STR, "maxItems": 3}
# Entities and their fields; a request's schema requires a seeded subset of one entity's fields (in this order).
_ENTITIES: dict[str, dict[str, dict[str, Any]]] = {
    "person": {
        "name": _STR,
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": _STR,
        "city": _STR,
        "hobbies": _LIST,
    },
    "book": {
        "title": _STR,
        "author": _STR,
        "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
        "genres": _LIST,
        "in_print": {"type": "boolean"},
    },
    "product": {
        "name": _STR,
        "price": {"type": "number", "minimum": 0},
        "currency": {"type": "string", "enum": ["USD", "EUR", "VND"]},
        "tags": _LIST,
        "in_stock": {"type": "boolean"},
    },
    "city": {"name": _STR, "country": _STR, "population": {"type": "integer", "minimum": 0}, "landmarks": _LIST},
    "event": {
        "title": _STR,
        "venue": _STR,
        "attendees": {"type": "integer", "minimum": 0},
        "online": {"type": "boolean"},
        "speakers": _LIST,
    },
}
_PLACES = ("Hanoi", "Lyon", "Osaka", "Lima", "Nairobi", "Oslo", "Austin", "Porto")


def entity_schemas(num_schemas: int, seed: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """`num_schemas` seeded (entity, JSON schema) pairs: each requires a subset (two or more) of one entity's
    fields (person, book, product, city, event), strings and lists bounded, no other properties."""
    rng = random.Random(seed)
    schemas = []
    for _ in range(num_schemas):
        entity = rng.choice(sorted(_ENTITIES))
        names = list(_ENTITIES[entity])
        kept = [n for n in names if rng.random() < 0.7]
        kept = kept if len(kept) >= 2 else names[:2]
        schemas.append(
            (
                entity,
                {
                    "type": "object",
                    "properties": {n: _ENTITIES[entity][n] for n in kept},
                    "required": kept,
                    "additionalProperties": False,
                },
            )
        )
    return schemas


def json_schema_requests(
    num_requests: int, tokenizer, output_len: int = 128, num_schemas: int = 8, seed: int = 0
) -> list[BenchRequest]:
    """Guided-decoding requests: each asks for an entity from a seeded place as JSON and carries the schema it
    must follow, one of `num_schemas` (entity_schemas), so schemas repeat and the grammar compile cache sees hits
    as in real traffic. `output_len` is a cap: a request ends when its JSON is complete."""
    if num_schemas < 1:
        raise ValueError(f"num_schemas: must be >= 1, got {num_schemas}")
    schemas = entity_schemas(num_schemas, seed)
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        entity, schema = rng.choice(schemas)
        text = (
            f"Describe a {entity} from {rng.choice(_PLACES)} as a JSON object with the fields "
            f"{', '.join(schema['required'])}, following this JSON schema: {json.dumps(schema)}"
        )
        requests.append(
            BenchRequest(chat_prompt_ids(tokenizer, text), output_len, ignore_eos=False, json_schema=schema)
        )
    return requests


_FUNCTION = '''def {name}({arg}):
    """Return the {what} of the {noun} in {arg} that are {cmp} {limit}."""
    {acc} = {init}
    for {item} in {arg}:
        if {item} {op} {limit}:
            {acc} {aug} {item}
    return {acc}
'''
_NOUNS = ("prices", "scores", "weights", "distances", "readings", "counts", "lengths", "votes")
_KINDS = (("sum", "0", "+=", "total"), ("product", "1", "*=", "result"))
_OPS = ((">", "above"), ("<", "below"), (">=", "at least"), ("<=", "at most"))


def _code_passage(rng: random.Random, num_functions: int) -> tuple[str, list[str]]:
    """Python functions from one template with seeded names and constants; returns the code and its arguments."""
    functions, args = [], []
    for noun in rng.sample(_NOUNS, num_functions):
        what, init, aug, acc = rng.choice(_KINDS)
        op, cmp = rng.choice(_OPS)
        args.append(f"{noun}_list")
        functions.append(
            _FUNCTION.format(
                name=f"{what}_of_{noun}",
                arg=args[-1],
                what=what,
                noun=noun,
                cmp=cmp,
                limit=rng.randint(1, 99),
                acc=acc,
                init=init,
                item=noun[:-1],
                op=op,
                aug=aug,
            )
        )
    return "\n\n".join(functions), args


def editing_requests(
    num_requests: int, tokenizer, num_functions: tuple[int, int] = (2, 4), seed: int = 0
) -> list[BenchRequest]:
    """Input-grounded editing prompts: a seeded passage of Python functions and an instruction to rewrite it whole
    with one identifier renamed, so the answer repeats long spans of the prompt (what n-gram and other drafters
    predict well). Each request may stop at EOS; its cap is the passage's length plus a quarter plus 16."""
    lo, hi = num_functions
    if not 1 <= lo <= hi <= len(_NOUNS):
        raise ValueError(f"num_functions: expected 1 <= low <= high <= {len(_NOUNS)}, got {lo} {hi}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        code, args = _code_passage(rng, rng.randint(lo, hi))
        old = rng.choice(args)
        text = (
            f"Rewrite the following Python code in full, renaming `{old}` to `{old.split('_')[0]}_seq` "
            f"everywhere and changing nothing else.\n\n```python\n{code}```"
        )
        passage_len = len(tokenizer.encode(code, add_special_tokens=False))
        requests.append(BenchRequest(chat_prompt_ids(tokenizer, text), passage_len * 5 // 4 + 16, ignore_eos=False))
    return requests


# Each dataset's arguments unless given (CPU-sized: a 2-core machine serves a few requests per second).
DATASET_DEFAULTS: dict[str, dict[str, Any]] = {
    "random": {"input_len": 256, "output_len": 64, "range_ratio": 0.0},
    "prefix_repetition": {"prefix_len": 256, "suffix_len": 64, "num_prefixes": 4, "output_len": 64},
    "json_schema": {"output_len": 128, "num_schemas": 8},
    "editing": {"num_functions": (2, 4)},
}
DATASETS = tuple(DATASET_DEFAULTS)


def sample_dataset(name: str, tokenizer, num_requests: int, seed: int = 0, **args: Any) -> list[BenchRequest]:
    """The requests of dataset `name` (DATASETS); `args`: that dataset's own keyword arguments
    (random_dataset, prefix_repetition_requests, json_schema_requests, editing_requests), over DATASET_DEFAULTS."""
    if name not in DATASET_DEFAULTS:
        raise ValueError(f"dataset: must be one of {', '.join(DATASETS)}, got {name!r}")
    unknown = sorted(set(args) - set(DATASET_DEFAULTS[name]))
    if unknown:
        raise ValueError(f"dataset {name}: unknown argument {unknown[0]} (known: {', '.join(DATASET_DEFAULTS[name])})")
    args = {**DATASET_DEFAULTS[name], **args}
    if name == "random":
        return random_dataset(num_requests, token_range=token_id_range(tokenizer), seed=seed, **args)
    if name == "prefix_repetition":
        return prefix_repetition_requests(num_requests, token_range=token_id_range(tokenizer), seed=seed, **args)
    if name == "json_schema":
        return json_schema_requests(num_requests, tokenizer, seed=seed, **args)
    return editing_requests(num_requests, tokenizer, seed=seed, **args)
