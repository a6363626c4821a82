"""The simulator against the real engine on this machine: calibrate the `cpu` cost model on one workload, predict a
different, held-out one.

1. Measure the machine as `bench roofline` does (read bandwidth, fp32 matmul peak).
2. Calibration workload (random prompts of mixed lengths, all at once): run the real engine, keep every StepRecord,
   and fit the efficiency factors (compute, memory, attention and a GEMM's unfilled tile rows: a grid, coarse then
   fine; the GEMV/GEMM switch is the CPU kernels' own PACKED_SMALL_M, the engine's linears having their panels
   packed at load) and the fixed costs (per step, per request, per token:
   least squares on what the roofline leaves) that minimise the median relative error of the predicted step time
   over its steps.
3. Held-out workload (shared prefixes and mixed lengths, Poisson arrivals, a smaller token budget, so chunked prefill
   and prefix hits happen): run the real engine; predict each of its steps from the batch it ran (step-time error);
   then run the simulated engine on the same requests and arrivals and compare TTFT and ITL p50 / p90.
4. Write the factors and the machine's numbers to engine/executor/sim/calibration.json (hardware `cpu` reads them).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from engine import LLM, StepRecord
from engine.events import PrefixLookup, RequestScheduled, RequestTokens
from engine.executor.sim.cost_model import CostModel, ScheduledShape
from engine.executor.sim.hardware import CALIBRATION_PATH, Efficiency, get_hardware, hardware_table
from engine.executor.sim.model_spec import load_model_spec
from kernels.cpu.ops import PACKED_SMALL_M
from workbench.bench.args import add_common_args, positive_float, positive_int, run_with_flags
from workbench.bench.datasets import prefix_repetition_requests, random_dataset, token_id_range
from workbench.bench.report import Part, Table, bold, described, formatters, machine_info, percentile, run_settings
from workbench.bench.roofline import measure_bandwidth, measure_matmul
from workbench.bench.serve import compute_metrics, request_arrivals, run_serve_once

HELP = "fit the cpu cost model on one workload, predict a held-out one (the simulator's error)"

GRID = np.geomspace(0.02, 1.0, 9)
FILL_GRID = (0.0, 4.0, 8.0, 16.0, 32.0, 64.0)  # GEMM tile rows left unfilled: none up to a 64-row tile


def step_shapes(record: StepRecord) -> list[ScheduledShape]:
    """What a real step ran, from its events: each scheduled request's context before the step, its tokens, and
    one row of logits if it received a token."""
    sampled = {e.request_id for e in record.of_type(RequestTokens)}
    return [
        ScheduledShape(e.num_computed_tokens, e.num_tokens, int(e.request_id in sampled))
        for e in record.of_type(RequestScheduled)
    ]


def _roofline_seconds(model: CostModel, batches: Sequence[list[ScheduledShape]], eff: Efficiency) -> np.ndarray:
    model.eff = eff
    return np.array([model.step_cost(b).total_s for b in batches])


def _fit_overheads(measured: np.ndarray, roofline: np.ndarray, features: np.ndarray) -> np.ndarray:
    """Per step, per request and per token seconds (each >= 0) by least squares on the relative residual."""
    weights = 1 / measured
    coef, *_ = np.linalg.lstsq(features * weights[:, None], (measured - roofline) * weights, rcond=None)
    return np.clip(coef, 0.0, None)


def fit_efficiency(
    model: CostModel, batches: Sequence[list[ScheduledShape]], measured_s: Sequence[float], gemv_max_rows: int = 0
) -> tuple[Efficiency, float]:
    """The factors that minimise the median relative error of predicted step times; returns them and that error.
    `gemv_max_rows` is known, not fitted: the rows up to which the kernels run a linear as a GEMV."""
    measured = np.asarray(measured_s)
    features = np.array([[1.0, len(b), sum(x.num_new for x in b)] for b in batches])
    best: tuple[float, Efficiency] = (math.inf, Efficiency())

    def search(
        grid_c: Iterable[float], grid_m: Iterable[float], grid_a: Iterable[float], grid_f: Iterable[float]
    ) -> None:
        nonlocal best
        for c, m, a, f in itertools.product(grid_c, grid_m, grid_a, grid_f):
            base = Efficiency(
                compute=float(c),
                memory=float(m),
                attention=float(a),
                gemm_fill_rows=float(f),
                gemv_max_rows=gemv_max_rows,
            )
            roof = _roofline_seconds(model, batches, base)
            step, req, tok = _fit_overheads(measured, roof, features)
            predicted = roof + features @ np.array([step, req, tok])
            error = float(np.median(np.abs(predicted - measured) / measured))
            if error < best[0]:
                best = (
                    error,
                    replace(
                        base, step_overhead_s=float(step), request_overhead_s=float(req), token_overhead_s=float(tok)
                    ),
                )

    search(GRID, GRID, GRID, FILL_GRID)
    e = best[1]
    fine = lambda x: np.clip(x * np.geomspace(0.7, 1.4, 5), 1e-3, 1.0)  # noqa: E731 - around the coarse best
    search(fine(e.compute), fine(e.memory), fine(e.attention), np.unique(e.gemm_fill_rows * np.geomspace(0.7, 1.4, 5)))
    model.eff = best[1]
    return best[1], best[0]


def _serve_records(llm: LLM, requests, arrivals) -> tuple[list, float, list[StepRecord]]:
    records: list[StepRecord] = []
    callback = llm.engine.subscribe(records.append)
    try:
        results, duration = run_serve_once(llm, requests, arrivals, progress=False)
    finally:
        llm.engine.unsubscribe(callback)
    return results, duration, records


def _errors(predicted: Sequence[float], measured: Sequence[float]) -> dict[str, float]:
    rel = [abs(p - m) / m for p, m in zip(predicted, measured)]
    return {"median_abs_error": statistics.median(rel), "p90_abs_error": percentile(rel, 90)}


def heldout_requests(tokenizer, num_requests: int, seed: int) -> list:
    """Half shared-prefix requests (4 prefixes of 160 tokens, 16..96-token suffixes), half random prompts of 32..480
    tokens; 16..48 output tokens each; shuffled."""
    rng = np.random.default_rng(seed)
    token_range = token_id_range(tokenizer)
    half = num_requests // 2
    shared = prefix_repetition_requests(half, 160, 56, 4, 32, token_range, seed)
    mixed = random_dataset(num_requests - half, 256, 32, 0.875, token_range, seed + 1)
    out = []
    for r in shared:  # vary the suffixes and outputs of the shared-prefix requests too
        cut = len(r.prompt_token_ids) - int(rng.integers(0, 40))
        out.append(type(r)(r.prompt_token_ids[:cut], int(rng.integers(16, 49))))
    out += mixed
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def run_calibrate(
    model: str = "smollm2-135m",
    num_requests: int = 32,
    heldout_rate: float = 2.0,
    calibration_budget: int = 512,
    heldout_budget: int = 256,
    seed: int = 0,
    runs: int = 5,
    calibration_path: str | None = str(CALIBRATION_PATH),
    engine_kwargs: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure, calibrate, predict the held-out workload; write the factors to `calibration_path` (None: don't)."""
    engine_kwargs = dict(engine_kwargs or {})
    bandwidth = measure_bandwidth(1 << 30, runs)["read"]
    peak = max(measure_matmul(2048, runs).values())  # by backend where roofline times several: the best
    log(f"machine: {bandwidth / 1e9:.2f} GB/s read, {peak / 1e9:.1f} GFLOP/s fp32")
    table = hardware_table()["cpu"]
    measured_hw = {
        **table,
        "memory_bandwidth": bandwidth,
        "interconnect_bandwidth": bandwidth,
        "flops": {k: peak for k in table["flops"]},
    }
    spec = load_model_spec(model)

    real = LLM(model=model, max_num_batched_tokens=calibration_budget, seed=seed, **engine_kwargs)
    dtype = real.engine.config.dtype
    calib = random_dataset(num_requests, 192, 32, 0.9, token_id_range(real.tokenizer), seed + 7)
    run_serve_once(real, calib[:2], [0.0, 0.0], progress=False)  # warm-up: first calls pay for allocation
    _, _, calib_records = _serve_records(real, calib, [0.0] * len(calib))
    batches = [step_shapes(r) for r in calib_records]
    measured = [r.timing["total"] / 1e3 for r in calib_records]
    cost_model = CostModel(spec, get_hardware({**measured_hw, "name": "cpu"}), 1, dtype)
    eff, calib_error = fit_efficiency(cost_model, batches, measured, PACKED_SMALL_M)
    log(f"calibrated on {len(batches)} steps: median step-time error {calib_error:.1%}, {eff}")

    # the held-out workload, real: a fresh engine with its own token budget
    real = LLM(model=model, max_num_batched_tokens=heldout_budget, seed=seed, **engine_kwargs)
    run_serve_once(real, calib[:2], [0.0, 0.0], progress=False)
    heldout = heldout_requests(real.tokenizer, num_requests, seed + 11)
    arrivals = request_arrivals(len(heldout), heldout_rate, 1.0, seed)
    real_results, real_duration, real_records = _serve_records(real, heldout, arrivals)
    predicted = [cost_model.step_cost(step_shapes(r)).total_s for r in real_records]
    step_error = _errors(predicted, [r.timing["total"] / 1e3 for r in real_records])
    log(f"held-out: {len(real_records)} real steps, median step-time error {step_error['median_abs_error']:.1%}")

    # the held-out workload, simulated with the calibrated factors
    fitted = {**measured_hw, "name": "cpu", "efficiency": vars(eff)}
    sim = LLM(
        model=model,
        executor="simulated",
        hardware=fitted,
        max_num_batched_tokens=heldout_budget,
        seed=seed,
        num_kv_blocks=real.engine.num_kv_blocks,
        dtype=dtype,
    )
    sim_results, sim_duration, sim_records = _serve_records(sim, heldout, arrivals)
    real_m, sim_m = compute_metrics(real_results, real_duration), compute_metrics(sim_results, sim_duration)
    latency = {
        f"{stat}_{m}_ms": {"real": real_m[f"{stat}_{m}_ms"], "simulated": sim_m[f"{stat}_{m}_ms"]}
        for m in ("ttft", "itl")
        for stat in ("median", "p90")
    }
    phases = {p for r in real_records for p in r.phases.values()}
    hits = sum(e.num_hit_tokens for r in real_records for e in r.of_type(PrefixLookup))
    result = {
        "model": model,
        "date": machine_info()["date"],
        "settings": run_settings(run_calibrate, locals(), omit=("calibration_path",), dtype=dtype),
        "machine": {"memory_bandwidth": bandwidth, "flops_float32": peak},
        "efficiency": vars(eff),
        "calibration_steps": len(batches),
        "calibration_error": calib_error,
        "heldout_steps": len(real_records),
        "heldout_phases": sorted(phases),
        "heldout_prefix_hit_tokens": hits,
        "step_time_error": step_error,
        "latency": latency,
        "duration_s": {"real": real_duration, "simulated": sim_duration},
        "simulated_steps": len(sim_records),
    }
    if calibration_path:
        write_calibration(calibration_path, result)
        log(f"wrote {calibration_path}")
    return result


def write_calibration(path: str | Path, result: dict[str, Any]) -> None:
    """The `cpu` entry's measured numbers and factors, which hardware `cpu` lays over its table entry."""
    path = Path(path)
    data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    m = result["machine"]
    data["_comment"] = (
        "Written by `workbench bench calibrate`: what it measured on this machine and the factors "
        "it fitted; engine/executor/sim/hardware.py lays each entry over hardware.json's."
    )
    data["cpu"] = {
        "memory_bandwidth": m["memory_bandwidth"],
        "interconnect_bandwidth": m["memory_bandwidth"],
        "flops": {"float32": m["flops_float32"], "bfloat16": m["flops_float32"], "float16": m["flops_float32"]},
        "efficiency": result["efficiency"],
        "source": (
            f"calibrated {result['date']} on {result['model']}: median step-time error "
            f"{result['calibration_error']:.1%} on the calibration workload, "
            f"{result['step_time_error']['median_abs_error']:.1%} held out"
        ),
    }
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser, budget=False)
    parser.set_defaults(runs=5)
    parser.add_argument("--num-requests", type=positive_int, default=32, help="per workload (default: 32)")
    parser.add_argument("--heldout-rate", type=positive_float, default=2.0, help="held-out arrivals, req/s")
    parser.add_argument("--calibration-budget", type=positive_int, default=512)
    parser.add_argument("--heldout-budget", type=positive_int, default=256)
    parser.add_argument(
        "--calibration-path",
        default=str(CALIBRATION_PATH),
        help="where the factors go (default: %(default)s); 'none' writes nothing",
    )


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench calibrate`: run_calibrate with the command line's settings."""
    path = None if args.calibration_path.lower() == "none" else args.calibration_path
    return run_with_flags(run_calibrate, args, calibration_path=path)


_HEADERS = ("metric", "real engine", "simulated", "error")


def _rows(result: dict[str, Any]) -> list[list[object]]:
    rows: list[list[object]] = [
        [
            "median step-time error (each real step predicted from its batch)",
            "",
            "",
            f"{result['step_time_error']['median_abs_error']:.1%}",
        ],
        ["p90 step-time error", "", "", f"{result['step_time_error']['p90_abs_error']:.1%}"],
    ]
    for key, v in result["latency"].items():
        stat, metric = key.split("_")[:2]
        rows.append(
            [
                f"{metric.upper()} {stat} ms",
                v["real"],
                v["simulated"],
                f"{abs(v['simulated'] - v['real']) / v['real']:.1%}",
            ]
        )
    d = result["duration_s"]
    rows.append(["duration s", d["real"], d["simulated"], f"{abs(d['simulated'] - d['real']) / d['real']:.1%}"])
    return rows


_TEXT = (
    "{model} ({dtype}) on this CPU ({bw:.2f} GB/s, {gflops:.1f} GFLOP/s fp32): fitted on {calibration_steps} "
    "steps (median error {calibration_error:.1%}): compute {eff_c:.3f}, memory {eff_m:.3f}, attention "
    "{eff_a:.3f}, GEMM tile fill {fill:.1f} rows above the {gemv} rows a GEMV takes, fixed {step_ms:.2f} ms/step "
    "+ {req_ms:.3f} ms/request + {tok_us:.1f} us/token"
)
_DOCS = _TEXT + (
    ". Calibration: {num_requests} random prompts of 19..365 tokens, 32 outputs, all at once, "
    "max_num_batched_tokens={calibration_budget}. Held out: {num_requests} requests (half on 4 shared "
    "160-token prefixes, half random 32..480-token prompts, 16..48 outputs) at {heldout_rate:g} req/s "
    "Poisson, max_num_batched_tokens={heldout_budget}: {heldout_steps} real steps, phases "
    "{phases}, {heldout_prefix_hit_tokens} prefix-hit tokens. Step-time error: each real held-out step "
    "priced by the calibrated cost model from the batch it ran (`step.timing` total). TTFT / ITL: the "
    "same requests and arrivals through the simulated executor (hardware `cpu` with these factors), "
    "against the real run. One run each; timings on this shared 2-core machine vary run to run.{note}"
)


def _parts(result: dict[str, Any]) -> list[Part]:
    e = result["efficiency"]
    values = {
        "bw": result["machine"]["memory_bandwidth"] / 1e9,
        "gflops": result["machine"]["flops_float32"] / 1e9,
        "eff_c": e["compute"],
        "eff_m": e["memory"],
        "eff_a": e["attention"],
        "fill": e.get("gemm_fill_rows", 0.0),
        "gemv": e.get("gemv_max_rows", 0),
        "step_ms": e["step_overhead_s"] * 1e3,
        "req_ms": e["request_overhead_s"] * 1e3,
        "tok_us": e["token_overhead_s"] * 1e6,
        "phases": ", ".join(result["heldout_phases"]),
    }
    err = result["step_time_error"]["median_abs_error"]
    verdict = "below" if err < 0.10 else "above"
    return [
        described(result, _TEXT, _DOCS, **values),
        Table(_HEADERS, _rows(result)),
        bold(f"held-out median step-time error {err:.1%}: {verdict} the 10% Vidur reports"),
    ]


format_text, format_markdown = formatters("The simulator against the real engine (calibrate, then predict)", _parts)
