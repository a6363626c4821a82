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
