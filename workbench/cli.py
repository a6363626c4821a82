"""The `workbench` command line. `workbench bench throughput|prefix|profile|serve|sweep|guided|roofline|spec|pd`
measure the engine; each prints a table and, with --write-docs, rewrites its own section of docs/BENCHMARKS.md;
`workbench bench gains` tabulates the gains their kept results show; `workbench bench all` runs every CPU benchmark.
`workbench run` runs prompts headless and records a step trace; `workbench export` turns step traces into a Chrome
trace for Perfetto.
`workbench tune` searches the engine's knobs for the most goodput under latency SLOs;
`workbench serve` serves the live dashboard; `workbench replay` serves the dashboards over a trace;
`workbench attach` serves the live dashboard of a running vLLM server, from its KV cache events and /metrics;
`workbench pd` runs prompts through prefill and decode engine processes that move KV through a connector;
`workbench train-draft` self-distils an EAGLE or Medusa head for a target model.
`workbench fidelity` checks the engine's decisions against vLLM 0.33.0's own scheduler, step by step."""

from __future__ import annotations

import argparse
import ast
import importlib
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from workbench.bench.args import add_common_args, non_negative_int, positive_int

BENCH_DIR = Path(__file__).resolve().parent / "bench"


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 1 to 65535, got {value}")
    return value


# ---- `workbench bench NAME`: the benchmarks, found in workbench/bench/ ------------------------------------------
@dataclass(frozen=True)
class Benchmark:
    """A `workbench bench NAME` subcommand: the module workbench/bench/NAME.py, which has `add_cli_args(parser)`
    (its flags) and `main(args)` (runs it, returns its result), plus `format_text(result)` and
    `format_markdown(result, command)`. `help` is its HELP, or else its docstring's first line; `in_all` is its
    IN_ALL, (place, extra flags) in `workbench bench all`, or None where `bench all` leaves it out."""

    name: str
    help: str
    in_all: tuple[int, list[str]] | None = None


def _literals(tree: ast.Module, names: tuple[str, ...]) -> dict[str, Any]:
    """The module-level assignments of `names` in `tree`, evaluated as literals."""
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update(
                {t.id: ast.literal_eval(node.value) for t in targets if isinstance(t, ast.Name) and t.id in names}
            )
    return found


def discover_benchmarks(folder: Path = BENCH_DIR) -> list[Benchmark]:
    """Every module of `folder` that defines `add_cli_args` and `main`, in its `bench all` place, then the others
    by name. Read from the source, not imported: the CLI starts without torch, and a benchmark is imported only
    when its subcommand is parsed."""
    found = []
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        if {"add_cli_args", "main"} <= {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}:
            constants = _literals(tree, ("HELP", "IN_ALL"))
            help_ = constants.get("HELP") or (ast.get_docstring(tree) or "").strip().split("\n")[0]
            found.append(Benchmark(path.stem, help_, constants.get("IN_ALL")))
    return sorted(found, key=lambda b: (b.in_all is None, b.in_all[0] if b.in_all else 0, b.name))


BENCHMARKS = discover_benchmarks()
# `bench all`: every CPU benchmark (gpu_kernels needs CUDA), each with its defaults plus these flags, in this order.
ALL_BENCHES = {b.name: b.in_all[1] for b in BENCHMARKS if b.in_all is not None}


class _LazyParser(argparse.ArgumentParser):
    """The parser of one subcommand: `add_flags(parser)` adds its flags the first time it parses or shows help, so
    that building the whole parser imports no benchmark, and no engine (the engine flags come from EngineConfig,
    which imports torch)."""

    def __init__(
        self, *args: Any, add_flags: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._add_flags = add_flags

    def _load(self) -> None:
        if self._add_flags is not None:
            add_flags, self._add_flags = self._add_flags, None
            add_flags(self)

    def parse_known_args(self, *args: Any, **kwargs: Any) -> Any:  # argparse's overloads, passed through
        self._load()
        return super().parse_known_args(*args, **kwargs)

    def format_usage(self) -> str:
        self._load()
        return super().format_usage()

    def format_help(self) -> str:
        self._load()
        return super().format_help()


def _cli_args_of(module: str) -> Callable[[argparse.ArgumentParser], None]:
    """The `add_cli_args` of `module`, imported when first called."""
    return lambda parser: importlib.import_module(module).add_cli_args(parser)


def _add_bench(commands: Any) -> None:
    bench = commands.add_parser("bench", help="benchmarks of the engine")
    benches = bench.add_subparsers(dest="bench_name", required=True, metavar="BENCHMARK", parser_class=_LazyParser)
    for b in BENCHMARKS:
        benches.add_parser(b.name, help=b.help, add_flags=_cli_args_of(f"workbench.bench.{b.name}")).set_defaults(
            bench=b.name
        )
    benches.add_parser(
        "all",
        help="every CPU benchmark in turn: " + ", ".join(ALL_BENCHES),
        add_flags=partial(add_common_args, runs=False, budget=False),
    ).set_defaults(bench="all")


def run_bench(args: argparse.Namespace, command: str, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark `args` names (its module's `main`), print its table, and with --write-docs rewrite its docs
    section and keep its result beside (unless the module says KEEPS_RESULT = False)."""
    module = importlib.import_module(f"workbench.bench.{args.bench}")
    result = module.main(args)
    out(module.format_text(result))
    if args.write_docs:
        from workbench.bench.report import write_result, write_section

        section = getattr(args, "docs_section", None) or args.bench
        write_section(args.docs_path, section, module.format_markdown(result, command))
        kept = ""
        if getattr(module, "KEEPS_RESULT", True):  # the numbers behind the section, for tables of several (gains)
            kept = f" and {write_result(Path(args.docs_path).parent / 'bench', section, result, command)}"
        out(f"wrote the {section} section of {args.docs_path}{kept}")
    return result


run_gains = run_bench  # `bench gains` reports as every benchmark does


def run_all(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, dict[str, Any]]:
    """`workbench bench all`: run each of ALL_BENCHES as its own command would (the same flags, recorded in the
    docs with --write-docs), one after the other."""
    parser = build_parser()
    defaults = parser.parse_args(["bench", "all"])
    shared = []  # the settings given to `all` that differ from the defaults pass on to each benchmark
    for flag, name in (
        ("--model", "model"),
        ("--seed", "seed"),
        ("--num-kv-blocks", "num_kv_blocks"),
        ("--docs-path", "docs_path"),
    ):
        if getattr(args, name) != getattr(defaults, name):
            shared += [flag, str(getattr(args, name))]
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
    docs = ["--docs-path", args.docs_path] if args.docs_path != defaults.docs_path else []
    argv = ["bench", "gains", *docs, *(["--write-docs"] if args.write_docs else [])]
    out(f"== workbench {shlex.join(argv)}")
    run_gains(parser.parse_args(argv), "workbench " + shlex.join(argv), out)
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_LazyParser)
    _add_bench(commands)
    # `workbench tune`: the benchmark module workbench/bench/tune.py (also `workbench bench tune`), flags on first use
    commands.add_parser(
        "tune",
        help="search the engine's knobs for the most goodput under latency SLOs",
        add_flags=_cli_args_of("workbench.bench.tune"),
    ).set_defaults(bench="tune")
    commands.add_parser(
        "run", help="run prompts headless to completion and record a step trace", add_flags=_add_run_args
    )
    _add_export(commands)
    commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible API of one engine and its live dashboard at /dashboard (127.0.0.1 by "
        "default)",
        add_flags=_add_serve_args,
    )
    _add_replay(commands)
    commands.add_parser(
        "attach",
        help="the live dashboard of a running vLLM server, from its KV cache events and its /metrics",
        add_flags=_add_attach_args,
    )
    commands.add_parser(
        "pd", help="disaggregated prefill/decode: N prefill + M decode engine processes", add_flags=_add_pd_args
    )
    commands.add_parser(
        "train-draft",
        help="self-distil an EAGLE, EAGLE-3 or Medusa draft head for a target, on a CPU",
        add_flags=_add_train_draft_args,
    )
    # `workbench fidelity run|record|check`: this engine against vLLM 0.33.0's own scheduler (workbench/fidelity/)
    commands.add_parser(
        "fidelity",
        help="check the engine's decisions against vLLM's own scheduler, step by step",
        add_flags=_cli_args_of("workbench.fidelity.command"),
    )
    return parser


def _add_train_draft_args(p: argparse.ArgumentParser) -> None:
    # the flags live here: workbench/train_draft.py imports torch, which the CLI does not until a command runs
    from engine.arg_utils import add_engine_args

    p.add_argument("--method", required=True, choices=("eagle", "medusa", "eagle3"))
    add_engine_args(p, include=["model"], title="the target")
    p.add_argument("--out", help="the head folder to write (default: the cache's draft_heads/MODEL/METHOD)")
    for flag, kind, default, what in (
        ("--num-prompts", positive_int, None, "the first N bundled prompts (default: all)"),
        ("--max-tokens", positive_int, 128, "answer length"),
        ("--temperature", float, 0.0, "the answers' temperature (0: greedy, as bench spec decodes)"),
        ("--epochs", positive_int, 4, "epochs"),
        ("--batch-size", positive_int, 8, "sequences per step"),
        ("--lr", float, 2e-3, "peak learning rate"),
        ("--seed", int, 0, "seed of the answers and the training"),
        ("--draft-vocab-size", positive_int, 4096, "tokens the head may draft"),
        ("--intermediate-size", positive_int, 768, "EAGLE and EAGLE-3's MLP width"),
        ("--num-heads", positive_int, 4, "Medusa's heads"),
        ("--num-hidden-layers", positive_int, 1, "Medusa's residual layers per head"),
        ("--unroll", positive_int, 3, "EAGLE(-3) steps unrolled in training, each reading the head's own state"),
        ("--ce-weight", float, 0.1, "EAGLE's weight of the token cross-entropy beside feature regression"),
        ("--check-prompts", non_negative_int, 8, "held-out prompts run through the engine with the head (0: skip)"),
    ):
        p.add_argument(flag, type=kind, default=default, help=f"{what} (default: %(default)s)")


def _add_run_args(p: argparse.ArgumentParser) -> None:
    from engine.arg_utils import add_engine_args

    p.add_argument("--prompts", required=True, help="a file with one prompt per line ('-': standard input)")
    p.add_argument(
        "--trace",
        required=True,
        help="the JSONL step trace to write (with --data-parallel-size, the front end's: routing, per-replica load, "
        "tokens)",
    )
    add_engine_args(p, exclude=["seed"])  # --seed is the prompts' sampling seed, as it was before these flags
    sampling = p.add_argument_group("sampling, for every prompt (default: SamplingParams')")
    sampling.add_argument("--temperature", type=float)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--min-p", type=float)
    sampling.add_argument("--max-tokens", type=positive_int)
    sampling.add_argument("--seed", type=int)
    sampling.add_argument("--ignore-eos", action="store_true")


_RUN_SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed")


def _read_prompts(path: str) -> list[str]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts: no prompt in {path!r} (one prompt per line)")
    return prompts


def run_prompts(args: argparse.Namespace, out: Callable[[str], None] = print) -> int:
    """`workbench run`: every prompt through LLMEngine.step() (with --data-parallel-size, the DP front end's
    step()) to completion, each step recorded in the trace; prints one line per output and a summary. Returns the
    number of steps run."""
    import json
    import time

    from engine import EngineConfig, SamplingParams
    from engine.arg_utils import engine_kwargs_from_args
    from engine.async_llm import build_engine
    from workbench.trace import TraceWriter

    prompts = _read_prompts(args.prompts)
    config = EngineConfig(**engine_kwargs_from_args(args))
    params = SamplingParams(
        ignore_eos=args.ignore_eos, **{k: getattr(args, k) for k in _RUN_SAMPLING_FLAGS if getattr(args, k) is not None}
    )
    engine = build_engine(config)
    try:
        ids = [engine.add_request(prompt, params) for prompt in prompts]  # refused before the trace is opened
        t0 = time.perf_counter()
        with TraceWriter(args.trace, engine) as writer:
            engine.subscribe(writer)
            while engine.has_unfinished_requests():
                engine.step()
        elapsed = time.perf_counter() - t0
        outputs = [engine.pop_output(rid) for rid in ids]
    finally:
        engine.close()  # worker or replica processes
    for o in outputs:
        out(f"[{o.request_id}] {o.finish_reason}, {len(o.token_ids)} tokens: {json.dumps(o.text, ensure_ascii=False)}")
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_output = sum(len(o.token_ids) for o in outputs)
    out(
        f"{len(outputs)} requests, {writer.num_records} steps, {num_prompt} prompt + {num_output} output tokens "
        f"in {elapsed:.2f} s ({num_output / max(elapsed, 1e-9):.1f} output tok/s); trace: {args.trace}"
    )
    return writer.num_records


def _add_export(commands: Any) -> None:
    p = commands.add_parser("export", help="convert step traces to a Chrome trace for ui.perfetto.dev")
    p.add_argument(
        "traces",
        nargs="+",
        metavar="TRACE",
        help="a JSONL step trace (several: the instances of one run, one process each)",
    )
    p.add_argument("--chrome", required=True, metavar="OUT.json", help="the Chrome trace JSON to write")


def export_trace(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    """`workbench export`: read the traces, write their Chrome trace, say what it holds."""
    from workbench.perfetto import export_chrome_trace
    from workbench.trace import read_trace

    traces = [read_trace(path) for path in args.traces]
    result = export_chrome_trace(traces, args.chrome)
    steps = sum(len(t.records) for t in traces)
    out(
        f"wrote {len(result['traceEvents'])} events ({steps} steps) to {args.chrome}; "
        "open it in https://ui.perfetto.dev or chrome://tracing"
    )
    return result


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from engine.arg_utils import add_engine_args

    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="as vLLM's `vllm serve MODEL` (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=_port, default=8000, help="(default: %(default)s)")
    p.add_argument(
        "--api-key",
        help="require the key on every route but /health and /metrics: `Authorization: "
        "Bearer KEY` for API clients; the dashboard asks for it once (a form, or ?key=KEY) and keeps it "
        "in a session cookie",
    )
    # their defaults are ServerLimits' (workbench/serving.py), which the help repeats: the CLI imports no engine code
    p.add_argument(
        "--max-num-queued-reqs",
        type=positive_int,
        help="vLLM's: past this many requests in flight (waiting or running), new ones get 503 (default: 1024)",
    )
    p.add_argument("--max-request-body-bytes", type=positive_int, help="larger request bodies get 413 (default: 4 MiB)")
    p.add_argument("--served-model-name", help="the name clients send as `model` (default: the model's)")
    # a small cache, so that the dashboard's block map reads well
    add_engine_args(p, defaults={"num_kv_blocks": 256})
    queued = p.add_argument_group("requests queued before any HTTP request; the loop then starts paused")
    queued.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="a prompt to queue, held until Step or Play on the dashboard (repeatable)",
    )
    queued.add_argument("--max-tokens", type=positive_int, default=32, help="(default: %(default)s)")
    queued.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s)")


def _add_replay(commands: Any) -> None:
    p = commands.add_parser("replay", help="serve the dashboards over a recorded trace, with a step slider")
    p.add_argument("trace", help="a JSONL step trace (workbench run --trace)")
    p.add_argument("--port", type=_port, default=5006, help="(default: %(default)s)")


def _add_attach_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-events",
        required=True,
        metavar="ENDPOINT",
        help="the server's KV events endpoint as reached from here, tcp://HOST:PORT (vLLM's tcp://*:5557 on HOST: "
        "tcp://HOST:5557)",
    )
    p.add_argument(
        "--replay", metavar="ENDPOINT", help="its replay_endpoint, tcp://HOST:PORT: read what it holds from batch 0"
    )
    p.add_argument("--metrics", metavar="URL", help="its Prometheus metrics, http://HOST:PORT/metrics")
    p.add_argument("--block-size", type=positive_int, help="the server's block size, where known")
    p.add_argument("--num-blocks", type=positive_int, help="the server's number of KV blocks, where known")
    p.add_argument("--topic", default="", help="the topic its kv_events_config names (default: none)")
    p.add_argument("--metrics-interval", type=float, default=1.0, help="seconds between scrapes (default: %(default)s)")
    p.add_argument("--port", type=_port, default=5006, help="the dashboard's port (default: %(default)s)")


def attach(args: argparse.Namespace) -> None:
    """`workbench attach`: the dashboard of a running server until interrupted. The port is checked, then each
    endpoint (a malformed one, or one where nothing answers, is an error naming its flag), before anything is
    announced."""
    from workbench.app import check_port

    check_port(args.port)
    from workbench.attach import Attachment
    from workbench.views.attached import serve_attach

    if not args.metrics_interval > 0:
        raise ValueError(f"--metrics-interval: expected seconds > 0, got {args.metrics_interval}")
    attachment = Attachment(
        args.kv_events,
        args.metrics,
        args.replay,
        args.block_size,
        args.num_blocks,
        args.topic,
        metrics_interval_s=args.metrics_interval,
    )
    serve_attach(attachment, args.port, announce=_announce(f"attached to {args.kv_events}: dashboard at "))


def _announce(what: str) -> Callable[[str], None]:
    """What serve and replay print once the server listens (nothing when it fails before)."""
    return lambda url: print(f"workbench: {what}{url} (Ctrl-C stops)", file=sys.stderr, flush=True)


def serve(args: argparse.Namespace) -> None:
    """`workbench serve [MODEL]`: the OpenAI-compatible API and, at /dashboard, the live view of that engine,
    until interrupted. The port is checked before the model loads; the URL is printed once the server listens."""
    from workbench.app import check_port

    check_port(args.port, args.host)
    from engine import EngineConfig, SamplingParams
    from engine.arg_utils import engine_kwargs_from_args
    from workbench.serving import ServerLimits, serve_openai

    model = args.model_tag or args.model
    config = EngineConfig(**{**engine_kwargs_from_args(args), "model": model})
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    where = "dashboard: {url}dashboard" + (" of the data-parallel front end" if config.data_parallel_size > 1 else "")
    serve_openai(
        config,
        args.host,
        args.port,
        args.api_key,
        args.prompt,
        params,
        args.served_model_name or model,
        announce=lambda url: _announce("serving ")(f"{url}v1 ({where.format(url=url)})"),
        limits=ServerLimits(
            **{
                k: getattr(args, k)
                for k in ("max_num_queued_reqs", "max_request_body_bytes")
                if getattr(args, k) is not None
            }
        ),
    )


def replay(args: argparse.Namespace) -> None:
    """`workbench replay`: the dashboards over a trace until interrupted. The trace is read, then the port bound
    (a port in use: an error that says so), before anything is announced."""
    from workbench.app import serve_replay

    serve_replay(args.trace, args.port, announce=_announce(f"replaying {args.trace} at "))


def _add_pd_args(p: argparse.ArgumentParser) -> None:
    from engine.arg_utils import add_engine_args

    p.add_argument("--prefill", type=positive_int, default=1, help="prefill instances (default: %(default)s)")
    p.add_argument("--decode", type=positive_int, default=1, help="decode instances (default: %(default)s)")
    p.add_argument("--connector", choices=("shared_storage", "redis"), default="shared_storage")
    add_engine_args(p, include=["model", "num_kv_blocks"])  # the instances' other settings are the cluster's
    p.add_argument("--prompts", help="a file with one prompt per line (default: a few samples)")
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
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
            else:
                run_bench(args, "workbench " + shlex.join(argv))
        elif args.command == "tune":
            run_bench(args, "workbench " + shlex.join(argv))
        elif args.command == "run":
            run_prompts(args)
        elif args.command == "export":
            export_trace(args)
        elif args.command == "serve":
            serve(args)
        elif args.command == "replay":
            replay(args)
        elif args.command == "attach":
            attach(args)
        elif args.command == "pd":
            from workbench.bench.pd import run_pd_command

            run_pd_command(args)
        elif args.command == "fidelity":
            from workbench.fidelity.command import main as fidelity

            return fidelity(args, "workbench " + shlex.join(argv))
        elif args.command == "train-draft":
            from workbench.train_draft import main as train_draft

            train_draft(args, "workbench " + shlex.join(argv))
    except (ValueError, OSError) as exc:  # bad settings, named by the engine or the workload generator; bad paths
        print(f"workbench: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
