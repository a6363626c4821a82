"""The runner's input preparation: the persistent block table, and every step's batch against a per-token
reference through chunked prefill, prefix hits, verification of drafts, preemption, aborts and reused ids."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.block_table import BlockTable
from engine.model.runner import DecodeInputs

BLOCK_SIZE = 4
DRAFT = {"method": "draft_model", "model": "tiny-llama", "num_speculative_tokens": 3}


# ---- BlockTable ---------------------------------------------------------------------------------------
def test_block_table_appends_only_new_blocks_and_reuses_freed_rows() -> None:
    table = BlockTable(block_size=4, max_num_reqs=2, max_num_blocks_per_req=3)
    assert table.append("a", [7]) == 0 and table.append("b", [5, 6]) == 1
    table.block_table_np[0, 0] = 9  # a written block is not written again: only the new one is
    assert table.append("a", [7, 3]) == 0
    assert table.block_table_np[0].tolist() == [9, 3, 0]
    table.remove(["a", "unknown"])
    assert len(table) == 1 and table.block_table_np[0].tolist() == [0, 0, 0]
    assert table.append("c", [2]) == 0  # the freed row, cleared: no stale block id as padding
    assert table.block_table_np.tolist() == [[2, 0, 0], [5, 6, 0]]


def test_block_table_slot_mapping() -> None:
    table = BlockTable(block_size=4, max_num_reqs=2, max_num_blocks_per_req=3)
    table.append("a", [7, 3])
    table.append("b", [5])
    slots = table.compute_slot_mapping(np.array([0, 0, 0, 1]), np.array([0, 3, 5, 2]))
    assert slots.dtype == np.int64 and slots.tolist() == [28, 31, 13, 22]


def test_block_table_limits_name_the_field() -> None:
    table = BlockTable(block_size=4, max_num_reqs=1, max_num_blocks_per_req=2)
    with pytest.raises(ValueError, match="max_num_blocks_per_req"):
        table.append("a", [1, 2, 3])
    table.append("a", [1])
    with pytest.raises(ValueError, match="max_num_reqs"):
        table.append("b", [2])


# ---- the runner's batch, step by step ----------------------------------------------------------------
def reference_batch(output, block_size: int) -> dict[str, list]:
    """The step's inputs token by token, straight from the SchedulerOutput."""
    ids, positions, slots, seq_lens, starts, logits, first_rows = [], [], [], [], [0], [], []
    max_blocks = max(len(s.block_ids) for s in output.scheduled)
    tables = [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in output.scheduled]
    for s in output.scheduled:
        start, n = s.num_computed_tokens, s.num_new_tokens
        ids += (s.request.all_token_ids + s.spec_token_ids)[start : start + n]
        for p in range(start, start + n):
            positions.append(p)
            slots.append(s.block_ids[p // block_size] * block_size + p % block_size)
        seq_lens.append(start + n)
        starts.append(starts[-1] + n)
        if s.samples:
            first_rows.append(len(logits))
            logits += range(len(ids) - 1 - len(s.spec_token_ids), len(ids))
    return {
        "input_ids": ids,
        "positions": positions,
        "slot_mapping": slots,
        "block_tables": tables,
        "seq_lens": seq_lens,
        "query_start_loc": starts,
        "logits_indices": logits,
        "first_rows": first_rows,
    }


def _as_lists(batch) -> dict[str, list]:
    attn = batch.attn
    return {
        "input_ids": batch.input_ids.tolist(),
        "positions": batch.positions.tolist(),
        "slot_mapping": attn.slot_mapping.tolist(),
        "block_tables": attn.block_tables.tolist(),
        "seq_lens": attn.seq_lens.tolist(),
        "query_start_loc": attn.query_start_loc.tolist(),
        "logits_indices": batch.logits_indices.tolist(),
        "first_rows": batch.first_rows,
    }


DTYPES = {"input_ids": torch.int64, "positions": torch.int64, "logits_indices": torch.int64}
ATTN_DTYPES = {
    "slot_mapping": torch.int64,
    "block_tables": torch.int32,
    "seq_lens": torch.int32,
    "query_start_loc": torch.int32,
}


class Checker:
    """Wraps a runner's prepare_inputs: checks each batch against reference_batch and notes what it saw."""

    def __init__(self, runner) -> None:
        self.runner, self.prepare = runner, runner.prepare_inputs
        self.seen: set[str] = set()
        self.first_seen: set[str] = set()
        self.steps = 0
        self.decode_steps = 0  # batches in DecodeInputs' buffers
        runner.prepare_inputs = self

    def __call__(self, output):
        batch = self.prepare(output)
        assert _as_lists(batch) == reference_batch(output, self.runner.block_size)
        assert [s.request_id for s in batch.sampling_rows] == [s.request_id for s in output.scheduled if s.samples]
        assert {k: getattr(batch, k).dtype for k in DTYPES} == DTYPES
        assert {k: getattr(batch.attn, k).dtype for k in ATTN_DTYPES} == ATTN_DTYPES
        self._note(output)
        buffer = self.runner.decode_inputs.i64.untyped_storage().data_ptr()  # a CPU runner has them
        self.decode_steps += batch.input_ids.untyped_storage().data_ptr() == buffer
        return batch

    def _note(self, output) -> None:
        self.steps += 1
        if output.preempted_req_ids:
            self.seen.add("preempted")
        for s in output.scheduled:
            if s.request_id not in self.first_seen and s.num_computed_tokens > 0:
                self.seen.add("prefix hit")
            self.first_seen.add(s.request_id)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, 49152) for _ in range(24)]
    motif = [rng.randrange(3, 49152) for _ in range(5)]
    return [
        shared + motif * 3,
        shared + [rng.randrange(3, 49152) for _ in range(30)],
        motif * 6,
        [rng.randrange(3, 49152) for _ in range(50)],
        shared + motif,
    ]


@pytest.mark.parametrize("drafts", [True, False], ids=["drafts", "no-drafts"])
def test_every_batch_matches_the_reference_and_rows_are_freed(prompts, drafts) -> None:
    # a small cache (preemption), a small budget (chunks), a shared prefix (hits), drafts (verification); without
    # drafts, the steps where every request decodes go through DecodeInputs
    llm = LLM(
        model="tiny-llama",
        block_size=BLOCK_SIZE,
        num_kv_blocks=40,
        max_num_batched_tokens=24,
        long_prefill_token_threshold=16,
        speculative_config=DRAFT if drafts else None,
    )
    eng = llm.engine
    checker = Checker(eng.runner)
    eng.subscribe(lambda record: checker.seen.update(record.phases.values()))  # phases are the StepRecord's
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=f"r{i}")
    for _ in range(3):
        eng.step()
    eng.abort("r3")  # mid-prefill or mid-decode: its row must be freed, and its id may come back
    eng.pop_output("r3")
    eng.add_request(prompts[0][:20], params, request_id="r3")
    while eng.has_unfinished_requests():
        eng.step()
    assert {"chunk", "preempted", "prefix hit"} | ({"verify"} if drafts else {"decode"}) <= checker.seen
    assert (checker.decode_steps > 0) is not drafts  # a proposer's steps never take the decode path
    assert len(eng.runner.block_table) > 0  # the last step's requests finished after it ran
    eng.step()  # the next step tells the runner who finished
    assert len(eng.runner.block_table) == 0
    assert not eng.runner.block_table.block_table_np.any()


def test_decode_inputs_reuse_their_buffers_and_views_by_shape() -> None:
    table = np.arange(24, dtype=np.int32).reshape(4, 6)
    inputs = DecodeInputs(max_num_reqs=4, max_blocks=6)
    first = inputs.fill([11, 12], [5, 9], [21, 37], table, [2, 0], 3)
    assert [t.tolist() for t in first[:6]] == [[11, 12], [5, 9], [21, 37], [0, 1], [6, 10], [0, 1, 2]]
    assert first[6].tolist() == [[12, 13, 14], [0, 1, 2]]
    again = inputs.fill([13, 14], [6, 10], [22, 38], table, [2, 0], 3)
    assert all(a is b for a, b in zip(first, again))  # the same views, now holding this step's values
    assert first[0].tolist() == [13, 14] and first[4].tolist() == [7, 11]
    one = inputs.fill([15], [7], [23], table, [3], 2)
    assert [t.tolist() for t in one] == [[15], [7], [23], [0], [8], [0, 1], [[18, 19]]]
    many = DecodeInputs(max_num_reqs=8, max_blocks=16)
    wide = np.ones((8, 16), dtype=np.int32)
    for n in range(1, 9):  # 128 shapes: the views of every shape met are not kept forever
        for blocks in range(1, 17):
            assert many.fill([1] * n, [0] * n, [0] * n, wide, list(range(n)), blocks)[6].shape == (n, blocks)
    assert 0 < len(many.views) <= DecodeInputs.MAX_VIEWS
