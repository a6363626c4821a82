"""The `workbench` command line. `workbench bench throughput|prefix|profile|serve|sweep|guided|roofline|spec|pd|kernels`
measure the engine; each prints a table and, with --write-docs, rewrites its own section of docs/BENCHMARKS.md;
`workbench bench gains` tabulates the gains their kept results show; `workbench bench all` runs every CPU benchmark.
`workbench run` runs prompts headless and records a step trace; `workbench export` turns step traces into a Chrome
trace for Perfetto.
`workbench serve` serves the live dashboard; `workbench replay` serves the dashboards over a trace;
`workbench pd` runs prompts through prefill and decode engine processes that move KV through a connector."""
from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

from workbench.bench.report import DEFAULT_DOCS_PATH

DEFAULT_MODEL = "smollm2-135m"


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its error messages
    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 1 to 65535, got {value}")
    return value


def _common(parser: argparse.ArgumentParser, runs: bool = True, budget: bool = True) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name or HF folder (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    if runs:
        parser.add_argument("--runs", type=_positive_int, default=3, help="timed runs per side; medians (default: 3)")
    if budget:
        parser.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048,
                            help="the engine's token budget per step (default: %(default)s)")
    parser.add_argument("--num-kv-blocks", type=_positive_int, default=None,
                        help="KV cache size in blocks (default: sized from the engine's kv_cache_memory)")
    parser.add_argument("--write-docs", action="store_true", help="rewrite this benchmark's section of the docs")
    parser.add_argument("--docs-path", default=str(DEFAULT_DOCS_PATH), help="the docs file (default: %(default)s)")


def _add_throughput(sub: Any) -> None:
    p = sub.add_parser("throughput", help="engine vs transformers generate on a mixed workload")
    _common(p)
    p.add_argument("--num-requests", type=_positive_int, default=32)
    p.add_argument("--input-len-range", type=_positive_int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    p.add_argument("--output-len-range", type=_positive_int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--hf-batch-size", type=_positive_int, default=8, help="transformers static batch size")
    p.add_argument("--no-baseline", action="store_true", help="time the engine only")
    p.set_defaults(bench="throughput", kwargs=lambda a: dict(
        num_requests=a.num_requests, input_len_range=tuple(a.input_len_range),
        output_len_range=tuple(a.output_len_range), runs=a.runs, baseline=not a.no_baseline,
        batch_size=a.hf_batch_size))


def _add_prefix(sub: Any) -> None:
    p = sub.add_parser("prefix", help="TTFT and throughput with prefix caching on vs off")
    _common(p)
    p.add_argument("--num-prefixes", type=_positive_int, default=5)
    p.add_argument("--prefix-len", type=_positive_int, default=512)
    p.add_argument("--suffix-len", type=_positive_int, default=128)
    p.add_argument("--num-requests", type=_positive_int, default=64)
    p.add_argument("--output-len", type=_positive_int, default=16)
    p.add_argument("--block-size", type=_positive_int, default=16)
    p.set_defaults(bench="prefix", kwargs=lambda a: dict(
        num_prefixes=a.num_prefixes, prefix_len=a.prefix_len, suffix_len=a.suffix_len,
        num_requests=a.num_requests, output_len=a.output_len, runs=a.runs, block_size=a.block_size))


def _add_profile(sub: Any) -> None:
    p = sub.add_parser("profile", help="where a decode step's time goes (cProfile, torch.profiler)")
    _common(p, runs=False)
    p.add_argument("--num-requests", type=_positive_int, default=32)
    p.add_argument("--prompt-len", type=_positive_int, default=256)
    p.add_argument("--steps", type=_positive_int, default=5, help="steps per method (plain, cProfile, torch)")
    p.add_argument("--warmup", type=_non_negative_int, default=2)
    p.add_argument("--top-ops", type=_non_negative_int, default=10, help="aten ops to list (0: skip torch.profiler)")
    p.set_defaults(bench="profile", kwargs=lambda a: dict(
        num_requests=a.num_requests, prompt_len=a.prompt_len, steps=a.steps, warmup=a.warmup, top_ops=a.top_ops))


def _add_kernels(sub: Any) -> None:
    p = sub.add_parser("kernels", help="the Triton kernels on a CUDA GPU: checks, timings, engine vs transformers")
    _common(p)
    p.add_argument("--batch-size", type=_positive_int, default=256, help="decode sequences (default: %(default)s)")
    p.add_argument("--context-len", type=_positive_int, default=4096, help="decode context (default: %(default)s)")
    p.add_argument("--num-requests", type=_positive_int, default=256, help="engine throughput workload")
    p.add_argument("--no-throughput", action="store_true", help="kernels only: skip engine vs transformers")
    p.set_defaults(bench="kernels", kwargs=lambda a: dict(
        batch_size=a.batch_size, context_len=a.context_len, runs=a.runs, num_requests=a.num_requests,
        throughput=not a.no_throughput))


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _dataset_args(a: argparse.Namespace) -> dict[str, Any]:
    """The flags of the chosen dataset that were given, under its generator's argument names."""
    flags = {"random": {"input_len": a.random_input_len, "output_len": a.random_output_len,
                        "range_ratio": a.random_range_ratio},
             "prefix_repetition": {"prefix_len": a.prefix_repetition_prefix_len,
                                   "suffix_len": a.prefix_repetition_suffix_len,
                                   "num_prefixes": a.prefix_repetition_num_prefixes,
                                   "output_len": a.prefix_repetition_output_len},
             "json_schema": {"output_len": a.json_output_len}, "editing": {}}[a.dataset_name]
    return {k: v for k, v in flags.items() if v is not None}


def _add_bench_serve(sub: Any) -> None:
    from workbench.bench.datasets import DATASETS

    p = sub.add_parser("serve", help="online serving: requests at a rate; TTFT, TPOT, ITL, E2E, goodput (vLLM keys)")
    _common(p, runs=False)
    p.add_argument("--dataset-name", choices=DATASETS, default="random")
    p.add_argument("--num-prompts", type=_positive_int, default=64)
    p.add_argument("--request-rate", type=_positive_float, default=float("inf"), help="req/s; inf: all at once")
    p.add_argument("--burstiness", type=_positive_float, default=1.0, help="Gamma shape; 1: Poisson (default)")
    p.add_argument("--max-concurrency", type=_positive_int, default=None)
    p.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS", help="SLOs, e.g. ttft:1000 tpot:100")
    p.add_argument("--result-file", default=None, help="write the results as JSON here")
    p.add_argument("--baseline", action="store_true", help="also serve the schedule with transformers generate")
    p.add_argument("--hf-batch-size", type=_positive_int, default=8, help="transformers static batch size")
    for flag in ("--random-input-len", "--random-output-len", "--prefix-repetition-prefix-len",
                 "--prefix-repetition-suffix-len", "--prefix-repetition-num-prefixes",
                 "--prefix-repetition-output-len", "--json-output-len"):
        p.add_argument(flag, type=_positive_int, default=None, help="(default: the dataset's)")
    p.add_argument("--random-range-ratio", type=float, default=None, help="in [0, 1) (default: 0)")
    p.set_defaults(bench="serve", kwargs=lambda a: dict(
        dataset=a.dataset_name, num_requests=a.num_prompts, dataset_args=_dataset_args(a),
        request_rate=a.request_rate, burstiness=a.burstiness, max_concurrency=a.max_concurrency,
        goodput=_goodput(a.goodput), baseline=a.baseline, hf_batch_size=a.hf_batch_size, result_file=a.result_file))


def _goodput(items: list[str]) -> dict[str, float]:
    from workbench.bench.serve import parse_goodput

    return parse_goodput(items)


def _add_sweep(sub: Any) -> None:
    p = sub.add_parser("sweep", help="TTFT, ITL, throughput as max_num_batched_tokens varies, with a long prompt")
    _common(p, budget=False)
    p.add_argument("--budgets", type=_positive_int, nargs="+", default=[32, 64, 128, 256, 512, 1024, 2048])
    p.add_argument("--num-requests", type=_positive_int, default=24)
    p.add_argument("--input-len", type=_positive_int, default=64)
    p.add_argument("--output-len", type=_positive_int, default=64)
    p.add_argument("--long-prompt-len", type=_positive_int, default=1500)
    p.add_argument("--request-rate", type=_positive_float, default=8.0, help="req/s (default: %(default)s)")
    p.add_argument("--plot", default=None, help="PNG to write, if matplotlib is installed "
                   "(default with --write-docs: img/sweep.png beside the docs)")
    p.set_defaults(bench="sweep", kwargs=lambda a: dict(
        budgets=a.budgets, num_requests=a.num_requests, input_len=a.input_len, output_len=a.output_len,
        long_prompt_len=a.long_prompt_len, request_rate=a.request_rate, runs=a.runs,
        plot_path=a.plot or (str(Path(a.docs_path).parent / "img" / "sweep.png") if a.write_docs else None)))


def _add_guided(sub: Any) -> None:
    p = sub.add_parser("guided", help="per-step cost of guided decoding (bitmask fill + apply) vs the forward")
    _common(p, runs=False)
    p.add_argument("--batch-sizes", type=_positive_int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=_positive_int, default=8, help="steps measured per batch size")
    p.add_argument("--output-len", type=_positive_int, default=256, help="cap on each JSON output")
    p.set_defaults(bench="guided", kwargs=lambda a: dict(batch_sizes=a.batch_sizes, steps=a.steps,
                                                         output_len=a.output_len))


def _add_roofline(sub: Any) -> None:
    p = sub.add_parser("roofline", help="a decode step against the machine's bandwidth and matmul floor")
    _common(p)
    p.add_argument("--batch-sizes", type=_positive_int, nargs="+", default=[1, 8, 64])
    p.add_argument("--prompt-len", type=_positive_int, default=128)
    p.add_argument("--steps", type=_positive_int, default=10, help="decode steps timed per batch size")
    p.add_argument("--bandwidth-mib", type=_positive_int, default=1024, help="array size for the bandwidth test")
    p.add_argument("--matmul-n", type=_positive_int, default=2048, help="square matmul size for the compute peak")
    p.set_defaults(bench="roofline", kwargs=lambda a: dict(
        batch_sizes=a.batch_sizes, prompt_len=a.prompt_len, steps=a.steps, runs=a.runs,
        bandwidth_bytes=a.bandwidth_mib << 20, matmul_n=a.matmul_n))


def _add_spec(sub: Any) -> None:
    p = sub.add_parser("spec", help="speculative decoding: tokens/s with and without drafts, batch 1 and 8")
    _common(p)
    p.add_argument("--k", type=_positive_int, default=4, help="draft tokens per step (default: %(default)s)")
    p.add_argument("--draft-model", default=None, help="the draft model (default: the target itself)")
    p.add_argument("--num-requests", type=_positive_int, default=8)
    p.add_argument("--output-len", type=_positive_int, default=96)
    p.set_defaults(bench="spec", kwargs=lambda a: dict(k=a.k, draft_model=a.draft_model, runs=a.runs,
                                                       num_requests=a.num_requests, output_len=a.output_len))


def _add_bench_pd(sub: Any) -> None:
    p = sub.add_parser("pd", help="disaggregated prefill/decode: decode ITL while long prompts arrive, vs one engine")
    _common(p)
    p.add_argument("--connector", choices=("shared_storage", "redis"), default="shared_storage",
                   help="the P/D run's store (default: %(default)s); both connectors' rates are measured")
    p.add_argument("--num-short", type=_positive_int, default=4, help="short requests decoding from t=0")
    p.add_argument("--short-len", type=_positive_int, default=64, help="their prompt tokens (default: %(default)s)")
    p.add_argument("--output-len", type=_positive_int, default=128, help="their output tokens (default: %(default)s)")
    p.add_argument("--num-long", type=_non_negative_int, default=4, help="long prompts (default: %(default)s)")
    p.add_argument("--long-len", type=_positive_int, default=1024, help="their tokens (default: %(default)s)")
    p.add_argument("--long-output-len", type=_positive_int, default=4, help="(default: %(default)s)")
    p.add_argument("--long-interval", type=_positive_float, default=3.0, help="s between long prompts (default: 3)")
    p.add_argument("--chunk-budget", type=_positive_int, default=256,
                   help="max_num_batched_tokens of the chunked-prefill engine (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    p.set_defaults(bench="pd", kwargs=lambda a: dict(
        connector=a.connector, runs=a.runs, num_short=a.num_short, short_len=a.short_len, output_len=a.output_len,
        num_long=a.num_long, long_len=a.long_len, long_output_len=a.long_output_len, long_interval=a.long_interval,
        chunk_budget=a.chunk_budget, json_path=a.json))


# `bench all`: every CPU benchmark (kernels needs CUDA), each with its defaults plus these flags.
ALL_BENCHES = {"throughput": [], "prefix": [], "profile": [],
               "serve": ["--request-rate", "1", "--baseline", "--goodput", "ttft:1000", "tpot:100"],
               "sweep": [], "guided": [], "roofline": [], "spec": ["--runs", "2"], "pd": []}


def _add_gains(sub: Any) -> None:
    p = sub.add_parser("gains", help="one table of prefix caching, guided and speculative decoding gains, from the "
                                     "results those benchmarks kept (nothing is re-run)")
    p.add_argument("--write-docs", action="store_true", help="rewrite the gains section of the docs")
    p.add_argument("--docs-path", default=str(DEFAULT_DOCS_PATH),
                   help="the docs file; results are read from bench/ beside it (default: %(default)s)")
    p.set_defaults(bench="gains")


def run_gains(args: argparse.Namespace, command: str, out: Callable[[str], None] = print) -> None:
    from workbench.bench import gains
    from workbench.bench.report import write_section

    records = gains.load_records(Path(args.docs_path).parent / "bench")
    rows = gains.gain_rows(records)
    out(gains.format_text(rows))
    if args.write_docs:
        write_section(args.docs_path, "gains", gains.format_markdown(rows, records, command))
        out(f"wrote the gains section of {args.docs_path}")


def _add_all(sub: Any) -> None:
    p = sub.add_parser("all", help="every CPU benchmark in turn: " + ", ".join(ALL_BENCHES))
    _common(p, runs=False, budget=False)
    p.set_defaults(bench="all")


def run_all(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, dict[str, Any]]:
    """`workbench bench all`: run each of ALL_BENCHES as its own command would (the same flags, recorded in the
    docs with --write-docs), one after the other."""
    shared = []  # the settings given to `all` that differ from the defaults pass on to each benchmark
    for flag, value, default in (("--model", args.model, DEFAULT_MODEL), ("--seed", args.seed, 0),
                                 ("--num-kv-blocks", args.num_kv_blocks, None),
                                 ("--docs-path", args.docs_path, str(DEFAULT_DOCS_PATH))):
        if value != default:
            shared += [flag, str(value)]
    parser = build_parser()
    results = {}
    for name, extra in ALL_BENCHES.items():
        argv = ["bench", name, *extra, *shared, *(["--write-docs"] if args.write_docs else [])]
        out(f"== workbench {shlex.join(argv)}")
        results[name] = run_bench(parser.parse_args(argv), "workbench " + shlex.join(argv), out)
    from workbench.bench.gains import FEATURES

    missing = [n for n in FEATURES if not (Path(args.docs_path).parent / "bench" / f"{n}.json").exists()]
    if missing:  # results are kept only with --write-docs, and ALL_BENCHES may leave some out
        out(f"== no gains table: no kept result of {', '.join(missing)} beside {args.docs_path}")
        return results
    docs = ["--docs-path", args.docs_path] if args.docs_path != str(DEFAULT_DOCS_PATH) else []
    argv = ["bench", "gains", *docs, *(["--write-docs"] if args.write_docs else [])]
    out(f"== workbench {shlex.join(argv)}")
    run_gains(parser.parse_args(argv), "workbench " + shlex.join(argv), out)
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = commands.add_parser("bench", help="benchmarks of the engine")
    benches = bench.add_subparsers(dest="bench_name", required=True, metavar="BENCHMARK")
    for add in (_add_throughput, _add_prefix, _add_profile, _add_bench_serve, _add_sweep, _add_guided, _add_roofline,
                _add_spec, _add_bench_pd, _add_kernels, _add_gains, _add_all):
        add(benches)
    _add_run(commands)
    _add_export(commands)
    _add_serve(commands)
    _add_replay(commands)
    _add_pd(commands)
    return parser


def run_bench(args: argparse.Namespace, command: str, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark `args` names, print its table, and write its docs section if asked."""
    module = importlib.import_module(f"workbench.bench.{args.bench}")
    run = getattr(module, f"run_{args.bench}")
    engine_kwargs = {} if args.num_kv_blocks is None else {"num_kv_blocks": args.num_kv_blocks}
    budget = {"max_num_batched_tokens": args.max_num_batched_tokens} if "max_num_batched_tokens" in args else {}
    result = run(model=args.model, seed=args.seed, engine_kwargs=engine_kwargs,
                 log=lambda line: print(line, file=sys.stderr), **budget, **args.kwargs(args))
    out(module.format_text(result))
    if args.write_docs:
        from workbench.bench.report import write_result, write_section

        write_section(args.docs_path, args.bench, module.format_markdown(result, command))
        # the numbers behind the section, for tables built from several benchmarks (bench gains)
        kept = write_result(Path(args.docs_path).parent / "bench", args.bench, result, command)
        out(f"wrote the {args.bench} section of {args.docs_path} and {kept}")
    return result


def _add_run(commands: Any) -> None:
    p = commands.add_parser("run", help="run prompts headless to completion and record a step trace")
    p.add_argument("--prompts", required=True, help="a file with one prompt per line ('-': standard input)")
    p.add_argument("--trace", required=True, help="the JSONL step trace to write")
    p.add_argument("--model", default=DEFAULT_MODEL, help="registry name or HF folder (default: %(default)s)")
    engine = p.add_argument_group("engine (default: EngineConfig's)")
    engine.add_argument("--block-size", type=_positive_int)
    engine.add_argument("--max-num-batched-tokens", type=_positive_int, help="the token budget per step")
    engine.add_argument("--long-prefill-token-threshold", type=_non_negative_int)
    engine.add_argument("--num-kv-blocks", type=_positive_int)
    engine.add_argument("--max-num-seqs", type=_positive_int)
    engine.add_argument("--scheduling-policy", choices=("fcfs", "priority"))
    engine.add_argument("--no-prefix-caching", action="store_true")
    sampling = p.add_argument_group("sampling, for every prompt (default: SamplingParams')")
    sampling.add_argument("--temperature", type=float)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--min-p", type=float)
    sampling.add_argument("--max-tokens", type=_positive_int)
    sampling.add_argument("--seed", type=int)
    sampling.add_argument("--ignore-eos", action="store_true")


_RUN_ENGINE_FLAGS = ("block_size", "max_num_batched_tokens", "long_prefill_token_threshold", "num_kv_blocks",
                     "max_num_seqs", "scheduling_policy")
_RUN_SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed")


def _read_prompts(path: str) -> list[str]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts: no prompt in {path!r} (one prompt per line)")
    return prompts


def run_prompts(args: argparse.Namespace, out: Callable[[str], None] = print) -> int:
    """`workbench run`: every prompt through LLMEngine.step() to completion, each step recorded in the
    trace; prints one line per output and a summary. Returns the number of steps run."""
    import json
    import time

    from engine import EngineConfig, LLMEngine, SamplingParams
    from workbench.trace import TraceWriter

    prompts = _read_prompts(args.prompts)
    config = EngineConfig(model=args.model, enable_prefix_caching=not args.no_prefix_caching,
                          **{k: getattr(args, k) for k in _RUN_ENGINE_FLAGS if getattr(args, k) is not None})
    params = SamplingParams(ignore_eos=args.ignore_eos,
                            **{k: getattr(args, k) for k in _RUN_SAMPLING_FLAGS if getattr(args, k) is not None})
    engine = LLMEngine(config)
    ids = [engine.add_request(prompt, params) for prompt in prompts]  # refused before the trace is opened
    t0 = time.perf_counter()
    with TraceWriter(args.trace, engine) as writer:
        engine.subscribe(writer)
        while engine.has_unfinished_requests():
            engine.step()
    elapsed = time.perf_counter() - t0
    outputs = [engine.pop_output(rid) for rid in ids]
    for o in outputs:
        out(f"[{o.request_id}] {o.finish_reason}, {len(o.token_ids)} tokens: {json.dumps(o.text, ensure_ascii=False)}")
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_output = sum(len(o.token_ids) for o in outputs)
    out(f"{len(outputs)} requests, {writer.num_records} steps, {num_prompt} prompt + {num_output} output tokens "
        f"in {elapsed:.2f} s ({num_output / max(elapsed, 1e-9):.1f} output tok/s); trace: {args.trace}")
    return writer.num_records


def _add_export(commands: Any) -> None:
    p = commands.add_parser("export", help="convert step traces to a Chrome trace for ui.perfetto.dev")
    p.add_argument("traces", nargs="+", metavar="TRACE",
                   help="a JSONL step trace (several: the instances of one run, one process each)")
    p.add_argument("--chrome", required=True, metavar="OUT.json", help="the Chrome trace JSON to write")


def export_trace(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    """`workbench export`: read the traces, write their Chrome trace, say what it holds."""
    from workbench.perfetto import export_chrome_trace
    from workbench.trace import read_trace

    traces = [read_trace(path) for path in args.traces]
    result = export_chrome_trace(traces, args.chrome)
    steps = sum(len(t.records) for t in traces)
    out(f"wrote {len(result['traceEvents'])} events ({steps} steps) to {args.chrome}; "
        "open it in https://ui.perfetto.dev or chrome://tracing")
    return result


def _add_serve(commands: Any) -> None:
    p = commands.add_parser("serve", help="serve the live dashboard (Panel, 127.0.0.1 only, offline)")
    p.add_argument("--port", type=_port, default=5006, help="(default: %(default)s)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="registry name or HF folder (default: %(default)s)")
    engine = p.add_argument_group("engine (default: EngineConfig's)")
    engine.add_argument("--block-size", type=_positive_int)
    engine.add_argument("--max-num-batched-tokens", type=_positive_int, help="the token budget per step")
    engine.add_argument("--long-prefill-token-threshold", type=_non_negative_int)
    engine.add_argument("--num-kv-blocks", type=_positive_int, default=256,
                        help="KV cache size in blocks, small so the block map reads well (default: %(default)s)")
    engine.add_argument("--max-num-seqs", type=_positive_int)
    engine.add_argument("--scheduling-policy", choices=("fcfs", "priority"))
    engine.add_argument("--no-prefix-caching", action="store_true")
    queued = p.add_argument_group("requests queued in each new session")
    queued.add_argument("--prompt", action="append", default=[], help="a prompt to queue (repeatable)")
    queued.add_argument("--max-tokens", type=_positive_int, default=32, help="(default: %(default)s)")
    queued.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s)")


def _add_replay(commands: Any) -> None:
    p = commands.add_parser("replay", help="serve the dashboards over a recorded trace, with a step slider")
    p.add_argument("trace", help="a JSONL step trace (workbench run --trace)")
    p.add_argument("--port", type=_port, default=5006, help="(default: %(default)s)")


def _announce(what: str) -> Callable[[str], None]:
    """What serve and replay print once the server listens (nothing when it fails before)."""
    return lambda url: print(f"workbench: {what}{url} (Ctrl-C stops)", file=sys.stderr, flush=True)


def serve(args: argparse.Namespace) -> None:
    """`workbench serve`: a Workbench per browser session until interrupted. The port is checked before the
    model loads; the URL is printed once the server listens."""
    from workbench.app import check_port, serve_workbench

    check_port(args.port)
    from engine import EngineConfig, SamplingParams

    config = EngineConfig(model=args.model, enable_prefix_caching=not args.no_prefix_caching,
                          **{k: getattr(args, k) for k in _RUN_ENGINE_FLAGS if getattr(args, k) is not None})
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    serve_workbench(config, args.port, args.prompt, params, announce=_announce("serving "))


def replay(args: argparse.Namespace) -> None:
    """`workbench replay`: the dashboards over a trace until interrupted. The trace is read, then the port bound
    (a port in use: an error that says so), before anything is announced."""
    from workbench.app import serve_replay

    serve_replay(args.trace, args.port, announce=_announce(f"replaying {args.trace} at "))


def _add_pd(commands: Any) -> None:
    p = commands.add_parser("pd", help="disaggregated prefill/decode: N prefill + M decode engine processes")
    p.add_argument("--prefill", type=_positive_int, default=1, help="prefill instances (default: %(default)s)")
    p.add_argument("--decode", type=_positive_int, default=1, help="decode instances (default: %(default)s)")
    p.add_argument("--connector", choices=("shared_storage", "redis"), default="shared_storage")
    p.add_argument("--model", default=DEFAULT_MODEL, help="registry name or HF folder (default: %(default)s)")
    p.add_argument("--prompts", help="a file with one prompt per line (default: a few samples)")
    p.add_argument("--max-tokens", type=_positive_int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-kv-blocks", type=_positive_int)
    p.add_argument("--trace-dir", help="write one step trace per instance here")
    p.add_argument("--stream", action="store_true", help="print each step's new text as the decode instances give it")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `workbench` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "bench":
            if args.bench == "all":
                run_all(args)
            elif args.bench == "gains":
                run_gains(args, "workbench " + shlex.join(argv))
            else:
                run_bench(args, "workbench " + shlex.join(argv))
        elif args.command == "run":
            run_prompts(args)
        elif args.command == "export":
            export_trace(args)
        elif args.command == "serve":
            serve(args)
        elif args.command == "replay":
            replay(args)
        elif args.command == "pd":
            from workbench.bench.pd import run_pd_command

            run_pd_command(args)
    except (ValueError, OSError) as exc:  # bad settings, named by the engine or the workload generator; bad paths
        print(f"workbench: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
