"""Chained block hashes: a full block's identity is hash(parent block's hash, its token ids, extra keys).

Two algorithms, as vLLM: "builtin" (Python's hash of a tuple, fast, stable only within a process when
extra keys hold strings) and "sha256" (over a canonical byte encoding: the same in every process and on
every machine, so KV can move between instances by hash).
"""
from __future__ import annotations

import hashlib
import json
import struct
from typing import Callable, Sequence

from engine.request import Request

BlockHash = int | bytes
ExtraKeys = tuple | None
HashFn = Callable[[BlockHash | None, Sequence[int], ExtraKeys], BlockHash]

# The parent of a request's first block. Fixed (not random) so that sha256 chains agree across processes.
_ROOT_SEED = b"inference-workbench/prefix-cache/v1"
_BUILTIN_ROOT = int.from_bytes(hashlib.sha256(_ROOT_SEED).digest()[:8], "little")
_SHA256_ROOT = hashlib.sha256(_ROOT_SEED).digest()


def builtin_hash(parent: BlockHash | None, token_ids: Sequence[int], extra: ExtraKeys) -> int:
    return hash((_BUILTIN_ROOT if parent is None else parent, tuple(token_ids), extra))


def sha256_hash(parent: BlockHash | None, token_ids: Sequence[int], extra: ExtraKeys) -> bytes:
    h = hashlib.sha256(_SHA256_ROOT if parent is None else parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra is not None:
        h.update(json.dumps(extra, separators=(",", ":"), sort_keys=True).encode())
    return h.digest()


HASH_FUNCTIONS: dict[str, HashFn] = {"builtin": builtin_hash, "sha256": sha256_hash}


def hash_hex(block_hash: BlockHash | None) -> str | None:
    """A short, JSON-safe spelling of a hash for events and views."""
    if block_hash is None:
        return None
    if isinstance(block_hash, bytes):
        return block_hash.hex()[:16]
    return f"{block_hash & 0xFFFFFFFFFFFFFFFF:016x}"


def extra_keys_for_block(request: Request, block_index: int) -> ExtraKeys:
    """The salt goes into the first block only: the whole chain then differs, so only same-salt requests share.
    The second slot is kept for adapter ids (LoRA) so adding them later does not reshape the key."""
    if block_index == 0 and request.cache_salt is not None:
        return (request.cache_salt, None)
    return None


def update_block_hashes(request: Request, block_size: int, hash_fn: HashFn) -> list[BlockHash]:
    """Extend `request.block_hashes` to cover every full block of its tokens (drafts excluded)."""
    hashes = request.block_hashes
    num_full = request.num_tokens // block_size
    tokens = request.all_token_ids
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_fn(parent, tokens[i * block_size:(i + 1) * block_size], extra_keys_for_block(request, i)))
    return hashes
