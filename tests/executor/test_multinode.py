"""Tensor parallelism over two "nodes" on loopback, as torch.distributed runs it across machines: this process is
node 0 (LLMEngine(..., nnodes=2) spawns rank 0 and hosts the store), a `python -m engine.distributed.launch`
subprocess is node 1 (rank 1). Greedy tokens equal one process's; the launcher exits when the engine closes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.distributed.nodes import node_ranks
from tests.net import free_port

PROMPTS = [[1, 504, 3458, 282, 4649, 314], list(range(20, 41))]
KW = dict(model="tiny-llama", num_kv_blocks=32, block_size=4, max_num_batched_tokens=16)


def _greedy(engine: LLMEngine) -> tuple[list[list[int]], list]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    records = engine.run(ids)
    return [list(engine.pop_output(i).token_ids) for i in ids], records


def test_ranks_split_evenly_over_nodes_and_a_bad_split_is_refused() -> None:
    assert [list(node_ranks(4, 2, n)) for n in range(2)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match=r"nnodes: 2 must divide tensor_parallel_size \(3\)"):
        EngineConfig(tensor_parallel_size=3, nnodes=2)


@pytest.mark.slow
def test_two_nodes_on_loopback_give_one_process_tokens(monkeypatch) -> None:
    port = free_port(count=2)
    monkeypatch.setenv("WORKBENCH_DIST_AUTHKEY", "loopback-test")
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine.distributed.launch",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--tensor-parallel-size",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
        ],
        env=dict(os.environ),
    )
    try:
        with LLMEngine(**KW, tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=port) as engine:
            assert len(engine.executor.pids) == 1  # rank 0 here; rank 1 is node 1's
            ours, records = _greedy(engine)
        assert node1.wait(timeout=60) == 0  # stopped by the engine's close
    finally:
        if node1.poll() is None:
            node1.kill()
    assert all([r["rank"] for r in rec.of_kind("parallel.step")[0].ranks] == [0, 1] for rec in records)
    assert ours == _greedy(LLMEngine(**KW))[0]
