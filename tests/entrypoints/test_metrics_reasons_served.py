"""The reasons at the server's /metrics (engine/metrics.py): vLLM's waiting-by-reason gauge and per-request
preemption histogram, the KV residency histograms, and the workbench's waiting and preemptions by reason, read as a
scraper reads them, agreeing with the engine's records."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.conftest import MODEL


def _scrape(served) -> dict[str, float]:
    """{name{reason or le}: value} of every sample."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{served.base_url}/metrics").text):
        for s in family.samples:
            label = s.labels.get("reason", s.labels.get("le"))
            out[f"{s.name}{{{label}}}" if label is not None else s.name] = s.value
    return out


def _idle(served) -> None:
    assert served.llm.wait_until_idle(60), "the engine did not go idle"


def test_the_reasons_are_scraped_as_vllm_names_them(served):
    _idle(served)
    records = []
    served.llm.subscribe(records.append)
    try:
        before = _scrape(served)
        client = served.client()
        for i in range(3):
            client.completions.create(model=MODEL, prompt=f"Question {i}?", max_tokens=4, temperature=0)
        _idle(served)
        after = _scrape(served)
    finally:
        served.llm.unsubscribe(records.append)
    preempted = [e for r in records for e in r.events if e.kind == "request.preempted"]
    # one observation per finished request, of its preemptions
    assert after["vllm:request_num_preemptions_count"] - before.get("vllm:request_num_preemptions_count", 0) == 3
    assert after["vllm:request_num_preemptions_sum"] - before.get("vllm:request_num_preemptions_sum", 0) == len(
        preempted
    )
    # idle: nobody waits, for any reason, in vLLM's split and in the workbench's
    assert after["vllm:num_requests_waiting"] == 0
    assert (
        after["vllm:num_requests_waiting_by_reason{capacity}"]
        == after["vllm:num_requests_waiting_by_reason{deferred}"]
        == 0
    )
    ours = {k: v for k, v in after.items() if k.startswith("workbench:num_requests_waiting_by_reason")}
    assert ours and not any(ours.values()) and "workbench:num_requests_waiting_by_reason{kv_blocks}" in ours
    assert "workbench:num_preemptions_by_reason_total{last_running}" in after
    for name in ("lifetime", "idle_before_evict", "reuse_gap"):
        assert f"vllm:kv_block_{name}_seconds_count" in after
