"""The model runner's persistent block table: one row per request, updated by appending new block ids."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class BlockTable:
    """Owns a preallocated [max_num_reqs, max_num_blocks_per_req] int32 table of KV block ids and which row each
    request holds. A request keeps its row from its first scheduled step until it finishes or is preempted; a step
    writes only the block ids it gained since the last one, so a decode step usually writes nothing. Entries past
    a row's block count stay 0 (the padding the attention metadata expects)."""

    def __init__(self, block_size: int, max_num_reqs: int, max_num_blocks_per_req: int) -> None:
        self.block_size = block_size
        self.block_table_np = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks_per_row = [0] * max_num_reqs
        self.req_id_to_row: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))  # pop() hands out the lowest row first

    def __len__(self) -> int:
        return len(self.req_id_to_row)

    def remove(self, req_ids: Iterable[str]) -> None:
        """Free the rows of requests that finished or were preempted (a preempted request's blocks are freed;
        it gets a new row, and new blocks, when it runs again). Unknown ids are ignored."""
        for req_id in req_ids:
            row = self.req_id_to_row.pop(req_id, None)
            if row is not None:
                self.block_table_np[row, : self.num_blocks_per_row[row]] = 0
                self.num_blocks_per_row[row] = 0
                self._free_rows.append(row)

    def append(self, req_id: str, block_ids: list[int]) -> int:
        """The request's row, after writing the block ids of `block_ids` (all of the request's blocks, in order)
        that the row does not hold yet. A request's blocks only grow while it holds a row."""
        row = self.req_id_to_row.get(req_id)
        if row is None:
            row = self._add_row(req_id)
        have, need = self.num_blocks_per_row[row], len(block_ids)
        if need > have:
            if need > self.block_table_np.shape[1]:
                raise ValueError(
                    f"block_ids: request {req_id!r} has {need} blocks, more than "
                    f"max_num_blocks_per_req ({self.block_table_np.shape[1]})"
                )
            self.block_table_np[row, have:need] = block_ids[have:]
            self.num_blocks_per_row[row] = need
        return row

    def _add_row(self, req_id: str) -> int:
        if not self._free_rows:
            raise ValueError(
                f"max_num_reqs: no free row for request {req_id!r}; all {self.block_table_np.shape[0]} rows are held"
            )
        row = self._free_rows.pop()
        self.req_id_to_row[req_id] = row
        return row

    def compute_slot_mapping(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The flat KV slot (block id x block_size + offset) of each token: `rows[i]`'s block at `positions[i]`."""
        block_numbers = self.block_table_np[rows, positions // self.block_size].astype(np.int64)
        return block_numbers * self.block_size + positions % self.block_size
