"""The token-budget sweep: chunked prefill's trade-off as `max_num_batched_tokens` varies.

Short requests arrive on a seeded Poisson schedule and decode together; in the second scenario one long prompt
arrives among them (at the middle request's time). A small budget cuts the long prefill into many chunks that
share each step with the running decodes: their inter-token latency stays low, but the long prompt waits longer
for its first token and the extra steps cost throughput. A large budget prefills it in one or two big steps:
throughput is higher, and every running request sees those steps as ITL spikes.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from engine import LLM
from workbench.bench.args import add_common_args, add_positive_ints, positive_float, positive_int, run_with_flags
from workbench.bench.datasets import BenchRequest, random_dataset, token_id_range
from workbench.bench.report import Part, Table, described, docs_only, formatters, percentile, run_settings
from workbench.bench.serve import RequestResult, request_arrivals, run_serve_once
from workbench.bench.timing import alternate, medians

HELP = "TTFT, ITL, throughput as max_num_batched_tokens varies, with a long prompt"
IN_ALL: tuple[int, list[str]] = (5, [])  # `workbench bench all` runs it: (place, flags)

DEFAULT_BUDGETS = (32, 64, 128, 256, 512, 1024, 2048)
SCENARIOS = {"short only": False, "with long prompt": True}


def sweep_workload(
    tokenizer,
    num_requests: int,
    input_len: int,
    output_len: int,
    long_prompt_len: int,
    request_rate: float,
    with_long: bool,
    seed: int = 0,
) -> tuple[list[BenchRequest], list[float], int]:
    """The short requests and their Poisson arrivals; `with_long` inserts one `long_prompt_len`-token prompt
    (same output length) at the middle, arriving with the request before it. Returns requests, arrivals and the
    long prompt's index (-1 without it)."""
    tokens = token_id_range(tokenizer)
    requests = random_dataset(num_requests, input_len, output_len, 0.0, tokens, seed)
    arrivals = request_arrivals(num_requests, request_rate, 1.0, seed)
    if not with_long:
        return requests, arrivals, -1
    mid = num_requests // 2
    long = random_dataset(1, long_prompt_len, output_len, 0.0, tokens, seed + 1)[0]
    return requests[:mid] + [long] + requests[mid:], arrivals[:mid] + [arrivals[max(mid - 1, 0)]] + arrivals[mid:], mid


def point_metrics(results: Sequence[RequestResult], duration: float, long_index: int) -> dict[str, float]:
    """One sweep point: TTFT of the short requests (mean, p90) and of the long prompt, ITL over every request
    (mean, p99, max), output and total throughput."""
    short = [r for i, r in enumerate(results) if i != long_index]
    itl = [gap * 1e3 for r in results for gap in r.itl] or [0.0]
    ttft = [r.ttft * 1e3 for r in short]
    return {
        "ttft_mean_ms": statistics.fmean(ttft),
        "ttft_p90_ms": percentile(ttft, 90),
        "long_ttft_ms": results[long_index].ttft * 1e3 if long_index >= 0 else float("nan"),
        "itl_mean_ms": statistics.fmean(itl),
        "itl_p99_ms": percentile(itl, 99),
        "itl_max_ms": max(itl),
        "output_throughput": sum(r.output_len for r in results) / duration,
        "total_token_throughput": sum(r.prompt_len + r.output_len for r in results) / duration,
        "duration": duration,
    }


def run_sweep(
    model: str = "smollm2-135m",
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    num_requests: int = 24,
    input_len: int = 64,
    output_len: int = 64,
    long_prompt_len: int = 1500,
    request_rate: float = 8.0,
    runs: int = 3,
    seed: int = 0,
    plot_path: str | None = None,
    engine_kwargs: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """For each budget, one engine serves both scenarios `runs` times (alternating); per-metric medians.
    Writes a PNG plot to `plot_path` when given and matplotlib is installed."""
    engine_kwargs = dict(engine_kwargs or {})
    points = []
    for budget in budgets:
        llm = LLM(model=model, max_num_batched_tokens=budget, seed=seed, **engine_kwargs)
        workloads = {
            name: sweep_workload(
                llm.tokenizer, num_requests, input_len, output_len, long_prompt_len, request_rate, with_long, seed
            )
            for name, with_long in SCENARIOS.items()
        }
        run_serve_once(llm, workloads["short only"][0][:2], [0.0, 0.0], progress=False)  # warm-up
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in SCENARIOS}
        serve = {
            name: partial(run_serve_once, llm, requests, arrivals, progress=False)
            for name, (requests, arrivals, _) in workloads.items()
        }
        for turn in alternate(serve, runs):  # each serving run times itself, from its first arrival
            samples[turn.side].append(point_metrics(*turn.value, workloads[turn.side][2]))
        for name, runs_metrics in samples.items():
            point = medians(runs_metrics)
            points.append({"budget": budget, "scenario": name, **point})
            log(
                f"budget {budget}, {name}: ITL p99 {point['itl_p99_ms']:.1f} ms, "
                f"{point['output_throughput']:.1f} output tok/s"
            )
        del llm  # free this engine's KV cache before the next one is built
    result = {
        "model": model,
        "settings": run_settings(run_sweep, locals(), omit=("plot_path",)),
        "points": points,
        "plot": None,
    }
    if plot_path and importlib.util.find_spec("matplotlib") is not None:
        plot_sweep(result, plot_path)
        result["plot"] = str(plot_path)
    return result


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser, budget=False)
    parser.add_argument("--budgets", type=positive_int, nargs="+", default=[32, 64, 128, 256, 512, 1024, 2048])
    add_positive_ints(parser, num_requests=24, input_len=64, output_len=64, long_prompt_len=1500)
    parser.add_argument("--request-rate", type=positive_float, default=8.0, help="req/s (default: %(default)s)")
    parser.add_argument(
        "--plot",
        default=None,
        help="PNG to write, if matplotlib is installed (default with --write-docs: img/sweep.png beside the docs)",
    )


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench sweep`: run_sweep with the command line's settings; with --write-docs the plot goes beside
    the docs unless --plot says where."""
    docs_plot = str(Path(args.docs_path).parent / "img" / "sweep.png") if args.write_docs else None
    return run_with_flags(run_sweep, args, plot_path=args.plot or docs_plot)


def plot_sweep(result: dict[str, Any], path: str | Path) -> None:
    """ITL p99, the long prompt's TTFT and output throughput against the budget (log scale), one line per
    scenario, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display here
    import matplotlib.pyplot as plt

    panels = (
        ("itl_p99_ms", "ITL p99 (ms)"),
        ("long_ttft_ms", "TTFT of the long prompt (ms)"),
        ("output_throughput", "output tok/s"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (key, label) in zip(axes, panels):
        for name in SCENARIOS:
            pts = [p for p in result["points"] if p["scenario"] == name]
            ax.plot([p["budget"] for p in pts], [p[key] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["settings"]["budgets"], labels=[str(b) for b in result["settings"]["budgets"]])
        ax.set_xlabel("max_num_batched_tokens")
        ax.set_ylabel(label)
    axes[0].legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


_HEADERS = (
    "budget",
    "scenario",
    "TTFT mean ms (short)",
    "TTFT p90 ms (short)",
    "TTFT ms (long)",
    "ITL mean ms",
    "ITL p99 ms",
    "ITL max ms",
    "output tok/s",
    "total tok/s",
)


def _rows(result: dict[str, Any]) -> list[list[object]]:
    return [
        [
            p["budget"],
            p["scenario"],
            p["ttft_mean_ms"],
            p["ttft_p90_ms"],
            "-" if p["scenario"] == "short only" else p["long_ttft_ms"],
            p["itl_mean_ms"],
            p["itl_p99_ms"],
            p["itl_max_ms"],
            p["output_throughput"],
            p["total_token_throughput"],
        ]
        for p in result["points"]
    ]


_WORKLOAD = (
    "{model}: {num_requests} requests of {input_len} prompt + {output_len} output tokens arriving at "
    "{request_rate:g} req/s (Poisson, seed {seed}); with long prompt: one {long_prompt_len}-token prompt "
    "arrives among them (at the middle); medians over {runs} run(s)"
)
_DOCS = _WORKLOAD + (
    ". Greedy, EOS ignored, chunked prefill on. One engine per `max_num_batched_tokens`. TTFT from "
    "arrival; ITL = gaps between the steps that gave a request tokens, over all requests. A small "
    "budget splits the long prefill into chunks that share steps with the running decodes (low ITL, "
    "late first token for the long prompt, more steps); a large one runs it in few big steps "
    "(throughput, ITL spikes).{note}"
)


def _parts(result: dict[str, Any]) -> list[Part]:
    plot = f"![token-budget sweep](img/{Path(result['plot']).name})" if result["plot"] else ""
    return [described(result, _WORKLOAD, _DOCS), Table(_HEADERS, _rows(result)), docs_only(plot)]


format_text, format_markdown = formatters("Token-budget sweep: chunked prefill's trade-off", _parts)
