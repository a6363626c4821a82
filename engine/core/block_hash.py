"""Chained block hashes: a full block's identity is hash((parent block's hash, its token ids, extra keys)).

vLLM 0.33's algorithms, bit-equal to its own (vllm/v1/core/kv_cache_utils.py `hash_block_tokens`,
vllm/utils/hashing.py): "sha256" (SHA-256 of the pickled tuple, vLLM's default) and "sha256_cbor" (SHA-256 of its
canonical CBOR, the same in any language). The first block's parent is vLLM's `NONE_HASH`: the algorithm applied
to the seed "vllm-none-hash", or to $PYTHONHASHSEED where that is set. So a block hash here names the same tokens as
the same hash in vLLM, and KV can move between instances (and processes) by hash. "builtin" is this engine's own
fast option: Python's hash of the tuple, stable only within one process.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import overload

import cbor2

from engine.request import Request

BlockHash = int | bytes
ExtraKeys = tuple | None
HashFn = Callable[[BlockHash | None, Sequence[int], ExtraKeys], BlockHash]

_DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def _sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


@functools.cache
def none_hash(algo: str) -> BlockHash:
    """vLLM's NONE_HASH for `algo`: the parent of every request's first block (read once per process, as vLLM
    reads $PYTHONHASHSEED once at start)."""
    seed = os.environ.get("PYTHONHASHSEED", _DEFAULT_NONE_HASH_SEED)
    if algo == "builtin":
        return hash(seed)
    return {"sha256": _sha256_pickle, "sha256_cbor": _sha256_cbor}[algo](seed)


def sha256_hash(parent: BlockHash | None, token_ids: Sequence[int], extra: ExtraKeys) -> bytes:
    return _sha256_pickle((parent or none_hash("sha256"), tuple(token_ids), extra))


def sha256_cbor_hash(parent: BlockHash | None, token_ids: Sequence[int], extra: ExtraKeys) -> bytes:
    return _sha256_cbor((parent or none_hash("sha256_cbor"), tuple(token_ids), extra))


def builtin_hash(parent: BlockHash | None, token_ids: Sequence[int], extra: ExtraKeys) -> int:
    return hash((none_hash("builtin") if parent is None else parent, tuple(token_ids), extra))


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256_hash, "sha256_cbor": sha256_cbor_hash, "builtin": builtin_hash}


@overload
def hash_hex(block_hash: BlockHash) -> str: ...
@overload
def hash_hex(block_hash: None) -> None: ...
def hash_hex(block_hash: BlockHash | None) -> str | None:
    """A short, JSON-safe spelling of a hash for events and views."""
    if block_hash is None:
        return None
    if isinstance(block_hash, bytes):
        return block_hash.hex()[:16]
    return f"{block_hash & 0xFFFFFFFFFFFFFFFF:016x}"


def extra_keys_for_block(request: Request, block_index: int) -> ExtraKeys:
    """vLLM's extra keys: the salt goes into the first block only, as ("cache_salt", salt) (an empty salt is no
    salt); the whole chain then differs, so only same-salt requests share. (vLLM puts LoRA names and multimodal
    hashes here too; this engine has neither.)"""
    if block_index == 0 and request.cache_salt:
        return (("cache_salt", request.cache_salt),)
    return None


def update_block_hashes(request: Request, block_size: int, hash_fn: HashFn) -> list[BlockHash]:
    """Extend `request.block_hashes` to cover every full block of its tokens (drafts excluded)."""
    hashes = request.block_hashes
    num_full = request.num_tokens // block_size
    tokens = request.all_token_ids
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_fn(parent, tokens[i * block_size : (i + 1) * block_size], extra_keys_for_block(request, i)))
    return hashes
