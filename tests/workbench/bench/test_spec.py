"""Smoke test of `workbench bench spec` on the tiny model (no timed assertions)."""

from __future__ import annotations

import torch
from transformers import AutoConfig

from engine import LLM
from engine.model.loader import resolve_model
from engine.spec_decode import draft_heads
from engine.spec_decode.draft_heads import save_head
from workbench import train_draft as td
from workbench.bench.datasets import BenchRequest
from workbench.bench.spec import METHODS, cache_blocks, format_markdown, format_text, run_spec


def _default_heads(tmp_path, monkeypatch) -> None:
    """Random tiny-llama heads where `workbench train-draft` would put them (the cache of heads), so run_spec finds
    them."""
    target = AutoConfig.from_pretrained(resolve_model("tiny-llama"))
    monkeypatch.setattr(draft_heads, "trained_heads_dir", lambda: tmp_path)
    ids = torch.arange(256)
    for config in (
        td.eagle_config(target, 64, 256, "tiny-llama"),
        td.eagle3_config(target, 64, 256, "tiny-llama"),
        td.medusa_config(target, 3, 256, "tiny-llama"),
    ):
        save_head(tmp_path / "tiny-llama" / config["method"], config, td.head_tensors(td.new_head(config, 0), ids), {})


def test_spec_bench_reports_every_configuration(tmp_path, monkeypatch) -> None:
    from workbench.bench import spec

    _default_heads(tmp_path, monkeypatch)
    built = []  # each engine's KV blocks: every drafting engine's cache sized to the workloads, not the 1 GiB default
    monkeypatch.setattr(spec, "LLM", lambda **kw: built.append(kw.get("num_kv_blocks")) or LLM(**kw))
    result = run_spec(
        model="tiny-llama", k=3, batch_sizes=(1, 4), num_requests=4, output_len=12, runs=1, log=lambda line: None
    )
    methods = METHODS  # chains, trees and dynamic schedules of every learned head, n-gram's dynamic too
    assert {"eagle3_tree", "medusa_dynamic", "ngram_dynamic"} <= set(methods)
    keys = {(r["workload"], r["batch"], r["method"]) for r in result["rows"]}
    assert keys == {(w, b, m) for w in ("editing", "chat") for b in (1, 4) for m in methods}
    for r in result["rows"]:
        assert r["output_tokens"] > 0 and r["seconds"] > 0
        if r["method"] == "draft_model":  # the target drafting for itself: every greedy draft stands
            assert r["acceptance_rate"] == 1.0
        if r["method"] == "none":
            assert r["speedup"] == 1.0 and r["draft_share"] == 0.0
        elif r["method"] == "ngram_dynamic":  # at 4 requests the schedule drafts nothing, and n-gram mirrors nothing
            assert 0 <= r["draft_share"] < 1
        else:
            assert 0 < r["draft_share"] < 1
    assert set(result["load_average"]) == {"before", "after"} and set(result["heads"]) == {"eagle", "eagle3", "medusa"}
    # 70 blocks each here, where tiny-llama's default 1 GiB cache is 65,536 of them
    assert built[0] is None and len(built) == len(methods) and all(0 < n <= 256 for n in built[1:]), built
    assert "## Speculative decoding" in format_markdown(result, "workbench bench spec")
    assert "Load average" in format_text(result)


def test_the_methods_take_turns_batch_by_batch(monkeypatch) -> None:
    """Each batch runs through every method before the next batch does: a slow spell of the host then falls on all
    methods alike (a method that ran all its batches in one spell had looked 1.3x faster than it was)."""
    from workbench.bench import spec

    calls, generate = [], spec._generate

    def noted(llm, batch):  # each batch's run, noted as it starts
        run = generate(llm, batch)
        return lambda: calls.append((llm.engine.spec_stats is None, batch[0].prompt_token_ids)) or run()

    monkeypatch.setattr(spec, "_generate", noted)
    run_spec(
        model="tiny-llama",
        k=2,
        batch_sizes=(1,),
        num_requests=3,
        output_len=4,
        runs=1,
        methods_=("ngram",),
        workloads_=("chat",),
        log=lambda line: None,
    )
    prompts = [p for _, p in calls[::2]]
    assert [plain for plain, _ in calls] == [True, False] * 3  # none, then n-gram, for each request
    assert prompts == [p for _, p in calls[1::2]] and len({tuple(p) for p in prompts}) == 3


def test_the_cache_holds_the_largest_batch_at_full_length_and_no_more() -> None:
    """Every engine of the bench is alive at once: at the default 1 GiB of cache each, its 13 methods held 17 GB and
    a CI worker was killed for memory. Each batch's requests at their full length, drafts included, are its need."""
    reqs = [BenchRequest([1] * n, out) for n, out in ((10, 6), (30, 3), (1, 1))]
    # 16-token blocks, 4 draft slots: 20 -> 2 blocks, 37 -> 3, 6 -> 1; batches of 2: (2 + 3), (1); plus the null block
    assert cache_blocks([reqs], [2], lookahead=4, block_size=16) == 6
    assert cache_blocks([reqs], [1], lookahead=4, block_size=16) == 4
    assert cache_blocks([reqs, reqs[:1]], [1, 3], lookahead=4, block_size=16) == 7
