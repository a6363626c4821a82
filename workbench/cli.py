"""The `workbench` command line. `workbench bench throughput|prefix|profile` measure the engine; each prints a
table and, with --write-docs, rewrites its own section of docs/BENCHMARKS.md."""
from __future__ import annotations

import argparse
import importlib
import shlex
import sys
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


def _common(parser: argparse.ArgumentParser, runs: bool = True) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name or HF folder (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    if runs:
        parser.add_argument("--runs", type=_positive_int, default=3, help="timed runs per side; medians (default: 3)")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = commands.add_parser("bench", help="benchmarks of the engine")
    benches = bench.add_subparsers(dest="bench_name", required=True, metavar="BENCHMARK")
    for add in (_add_throughput, _add_prefix, _add_profile):
        add(benches)
    return parser


def run_bench(args: argparse.Namespace, command: str, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark `args` names, print its table, and write its docs section if asked."""
    module = importlib.import_module(f"workbench.bench.{args.bench}")
    run = getattr(module, f"run_{args.bench}")
    engine_kwargs = {} if args.num_kv_blocks is None else {"num_kv_blocks": args.num_kv_blocks}
    result = run(model=args.model, seed=args.seed, max_num_batched_tokens=args.max_num_batched_tokens,
                 engine_kwargs=engine_kwargs, log=lambda line: print(line, file=sys.stderr), **args.kwargs(args))
    out(module.format_text(result))
    if args.write_docs:
        from workbench.bench.report import write_section

        write_section(args.docs_path, args.bench, module.format_markdown(result, command))
        out(f"wrote the {args.bench} section of {args.docs_path}")
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `workbench` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "bench":
            run_bench(args, "workbench " + shlex.join(argv))
    except ValueError as exc:  # bad settings, named by the engine or the workload generator
        print(f"workbench: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
