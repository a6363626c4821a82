"""`workbench bench dp_routing`: its counts on hand-made records, and a reduced run on tiny-llama through the CLI
(DP 2, routing by load then by prefix) whose counts add up and whose prefix routing hits at least as often as load
routing. No timed assertions."""

from __future__ import annotations

import json

import pytest

from engine.events import DPRouted, KVUsage, PrefixLookup, RequestPreempted, StepRecord
from workbench.bench import dp_routing
from workbench.cli import main


def _record(step: int, events: list) -> StepRecord:
    return StepRecord(step, step, step + 1, {}, {}, 0, 0, KVUsage(8, 0, 0, 8), {}, events)


def _routed(rid: str, replica: str) -> DPRouted:
    k = int(replica[-1])
    return DPRouted(
        step=1,
        request_id=rid,
        replica=replica,
        replica_index=k,
        rule="load",
        scores=(0, 0),
        waiting=(0, 0),
        running=(0, 0),
        prefix_hit_blocks=(0, 0),
        alive=(True, True),
        time_ns=0,
    )


def test_counts_take_each_requests_first_lookup_and_every_preemption() -> None:
    def lookup(rid: str, hit: int) -> PrefixLookup:
        return PrefixLookup(step=1, request_id=rid, num_queried_blocks=4, num_hit_blocks=hit // 16, num_hit_tokens=hit)

    records = {
        "dp-0": [
            _record(1, [lookup("a", 32), lookup("b", 0)]),
            _record(2, [RequestPreempted(step=2, request_id="a", num_computed_tokens=64, num_freed_blocks=4)]),
            _record(3, [lookup("a", 48)]),
        ],  # a preempted request looks again: not counted twice
        "dp-1": [_record(1, [lookup("c", 16)])],
    }
    routed = [_routed("a", "dp-0"), _routed("b", "dp-0"), _routed("c", "dp-1")]
    assert dp_routing.replica_counts(records, routed) == {
        "hit_tokens": 48,
        "num_preemptions": 1,
        "requests_per_replica": [2, 1],
    }


@pytest.mark.slow
def test_reduced_run_through_the_cli_counts_every_request_and_prefix_routing_hits_no_less(tmp_path, capsys):
    docs = tmp_path / "BENCHMARKS.md"
    docs.write_text(
        "# Benchmarks\n\n<!-- bench:dp_routing:start -->\nTHE OLD SECTION\n<!-- bench:dp_routing:end -->\n\nafter\n"
    )
    assert (
        main(
            [
                "bench",
                "dp_routing",
                "--num-waves",
                "3",
                "--wave-size",
                "4",
                "--num-prefixes",
                "2",
                "--prefix-len",
                "48",
                "--suffix-len",
                "8",
                "--output-len",
                "2",
                "--num-kv-blocks",
                "24",
                "--write-docs",
                "--docs-path",
                str(docs),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "by prefix vs by load: hit rate" in out
    kept = json.loads((tmp_path / "bench" / "dp_routing.json").read_text())
    result = kept["result"]
    assert result["settings"]["num_kv_blocks"] == 24 and result["settings"]["data_parallel_size"] == 2
    assert result["ceiling_hit_tokens"] == (12 - 2) * 48
    for rule in ("load", "prefix"):
        r = result[rule]
        assert sum(r["requests_per_replica"]) == 12 and len(r["requests_per_replica"]) == 2
        assert r["num_prompt_tokens"] == 12 * 56
        assert 0 <= r["hit_tokens"] <= result["ceiling_hit_tokens"]
        assert r["num_preemptions"] >= 0 and r["hit_rate"] == r["hit_tokens"] / r["num_prompt_tokens"]
    assert result["prefix"]["hit_rate"] >= result["load"]["hit_rate"]
    text = docs.read_text()
    assert "THE OLD SECTION" not in text and text.endswith("after\n")
    assert "## Data-parallel routing: by load against by cached prefix" in text
    assert "`workbench bench dp_routing --num-waves 3" in text and "| prefix (longest cached prefix" in text
