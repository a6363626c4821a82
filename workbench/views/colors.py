"""Colours the views agree on: one per request, and one per KV block state."""

from __future__ import annotations

import zlib

# Category10 without its light tones: every request colour must stand out from the free and cached-free cells
REQUEST_PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
FREE_COLOR = "#f0f0f0"
CACHED_FREE_COLOR = "#c6dbef"


def request_color(request_id: str) -> str:
    """A stable colour per request id (engine ids are counters: consecutive requests differ)."""
    key = int(request_id) if request_id.isdigit() else zlib.crc32(request_id.encode())
    return REQUEST_PALETTE[key % len(REQUEST_PALETTE)]
