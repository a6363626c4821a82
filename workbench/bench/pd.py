"""`workbench pd`: run prompts through a disaggregated prefill/decode cluster (PDCluster) and report each
request's route and each instance's KV transfers; optionally one step trace per instance (for Perfetto)."""
from __future__ import annotations

import argparse
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from engine.events import StepRecord

SAMPLE_PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:"]


def transfer_summary(records: dict[str, list[StepRecord]]) -> list[dict[str, Any]]:
    """Per instance: saves, loads and failures, bytes moved, and the bytes' rate over the time spent moving."""
    rows = []
    for instance, recs in records.items():
        events = [e for r in recs for e in r.events if e.kind.startswith("kv_transfer.")]
        moved = [e for e in events if e.kind != "kv_transfer.fail"]
        num_bytes, ms = sum(e.num_bytes for e in moved), sum(e.ms for e in moved)
        rows.append({"instance": instance, "steps": len(recs),
                     "saves": sum(e.kind == "kv_transfer.save" for e in events),
                     "loads": sum(e.kind == "kv_transfer.load" for e in events),
                     "fails": sum(e.kind == "kv_transfer.fail" for e in events),
                     "MB": num_bytes / 1e6, "ms": ms, "MB/s": num_bytes / 1e3 / ms if ms else 0.0})
    return rows


def write_traces(trace_dir: str, model: str, records: dict[str, list[StepRecord]]) -> list[Path]:
    """One JSONL step trace per instance, its header naming the instance (the Perfetto export reads it)."""
    from workbench.trace import SCHEMA_VERSION, write_trace

    out = Path(trace_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for instance, recs in records.items():
        header = {"schema_version": SCHEMA_VERSION, "instance": instance, "model": {"name": model},
                  "created": datetime.now(timezone.utc).isoformat()}
        paths.append(out / f"{instance}.jsonl")
        write_trace(paths[-1], header, recs)
    return paths


def run_pd_command(args: argparse.Namespace, out: Callable[[str], None] = print) -> int:
    from engine import SamplingParams
    from engine.kv_transfer import PDCluster

    prompts = SAMPLE_PROMPTS
    if args.prompts:
        text = Path(args.prompts).read_text(encoding="utf-8")
        prompts = [line for line in text.splitlines() if line.strip()]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    engine_kwargs = {"num_kv_blocks": args.num_kv_blocks} if args.num_kv_blocks else {}
    with PDCluster(model=args.model, connector=args.connector, num_prefill=args.prefill, num_decode=args.decode,
                   **engine_kwargs) as cluster:
        outs = cluster.generate(prompts, params)
        records = cluster.records()
    for o in outs:
        out(f"[{o.request_id}] {o.finish_reason}: {o.text!r}")
    out(f"{'instance':<12}{'steps':>7}{'saves':>7}{'loads':>7}{'fails':>7}{'MB':>10}{'ms':>10}{'MB/s':>10}")
    for row in transfer_summary(records):
        out(f"{row['instance']:<12}{row['steps']:>7}{row['saves']:>7}{row['loads']:>7}{row['fails']:>7}"
            f"{row['MB']:>10.3f}{row['ms']:>10.1f}{row['MB/s']:>10.1f}")
    if args.trace_dir:
        for path in write_traces(args.trace_dir, args.model, records):
            out(f"wrote {path}")
    return 0


def connector_throughput(model: str, connector: str, prompt_len: int = 512, runs: int = 3) -> dict[str, Any]:
    """Median save and load rates of one connector for a prompt's KV, in one process: a kv_both engine with
    prefix caching off saves each prompt's KV, then loads it back (a private store: a temp folder or redis)."""
    import contextlib
    import random
    import statistics
    import tempfile

    from engine import LLMEngine
    from engine.kv_transfer.redis_server import RedisServer

    with tempfile.TemporaryDirectory() as tmp, \
            (RedisServer() if connector == "redis" else contextlib.nullcontext()) as server:
        extra = {"url": server.url} if connector == "redis" else {"shared_storage_path": tmp}
        engine = LLMEngine(model=model, enable_prefix_caching=False, kv_transfer_config={
            "kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": extra})
        rng = random.Random(0)
        events = []
        for _ in range(runs):
            prompt = [rng.randrange(100, 40000) for _ in range(prompt_len)]
            saved = _complete(engine, prompt, {"do_remote_decode": True}, events)
            _complete(engine, prompt, saved, events)
    saves = [e for e in events if e.kind == "kv_transfer.save"]
    loads = [e for e in events if e.kind == "kv_transfer.load"]
    return {"model": model, "connector": connector, "tokens": prompt_len, "MB": saves[-1].num_bytes / 1e6,
            "save ms": statistics.median(e.ms for e in saves), "load ms": statistics.median(e.ms for e in loads),
            "save MB/s": statistics.median(e.mb_per_s for e in saves),
            "load MB/s": statistics.median(e.mb_per_s for e in loads)}


def _complete(engine, prompt: list[int], kv_params: dict | None, events: list) -> dict | None:
    from engine import SamplingParams

    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1), kv_transfer_params=kv_params)
    while engine.has_unfinished_requests():
        events.extend(e for e in engine.step().events if e.kind.startswith("kv_transfer."))
    return engine.pop_output(rid).kv_transfer_params
