"""llama.cpp as the benchmarks' measured peer, never a dependency: its `llama-bench` run as a child process on GGUF
files of the engine's own weights, one row of its JSON output per call. `make llamacpp-ref` builds both into
.llamacpp/ (llama-bench per instruction set in .llamacpp/ISA/bin/, the GGUFs in .llamacpp/gguf/), where
`bench decode` and `bench prefill` find them by default; their flags (`add_llamacpp_args`) name others."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REF_DIR = Path(__file__).resolve().parents[2] / ".llamacpp"
# The engine's weight format -> the GGUF type of the same weights (`make llamacpp-ref` writes f32, bf16 and q8_0):
# Q8_0 is llama.cpp's int8 with a scale per 32 weights, as close as llama.cpp comes to the engine's int8.
GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16", "int8": "Q8_0"}
# What a report keeps of each llama-bench row: its workload, its rates and what it ran on.
FIELDS = (
    "n_prompt",
    "n_gen",
    "n_depth",
    "n_batch",
    "n_ubatch",
    "n_threads",
    "flash_attn",
    "avg_ts",
    "stddev_ts",
    "samples_ts",
    "model_type",
    "cpu_info",
    "build_commit",
)


def default_llama_bench(isa: str = "native") -> Path | None:
    """`make llamacpp-ref`'s llama-bench for `isa` (native, avx2), or None where it was not built."""
    path = REF_DIR / isa / "bin" / "llama-bench"
    return path if path.is_file() else None


def default_ggufs(model: str) -> dict[str, str]:
    """The engine's weight format -> `make llamacpp-ref`'s GGUF of `model` in that format, those that exist."""
    found = {w: REF_DIR / "gguf" / f"{model}-{t.lower()}.gguf" for w, t in GGUF_TYPES.items()}
    return {w: str(path) for w, path in found.items() if path.is_file()}


def parse_llama_bench_json(text: str) -> list[dict[str, Any]]:
    """llama-bench's `-o json` output -> one dict per test it ran, with the FIELDS a report keeps."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"llama-bench: output is not JSON ({exc}): {text[:200]!r}") from exc
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"llama-bench: expected a list of tests, got {text[:200]!r}")
    missing = [f for f in FIELDS if any(f not in t for t in tests)]
    if missing:
        raise ValueError(f"llama-bench: its JSON lacks {', '.join(missing)} (another llama-bench version?)")
    return [{f: t[f] for f in FIELDS} for t in tests]


@dataclass(frozen=True)
class LlamaBench:
    """One llama-bench binary and how many threads it runs with: `run` times one test (`-r` repetitions after
    llama-bench's own warm-up) and returns its row."""

    binary: str
    threads: int

    def command(
        self,
        gguf: str,
        *,
        n_prompt: int,
        n_gen: int,
        depth: int = 0,
        batch: int = 2048,
        ubatch: int = 512,
        reps: int = 1,
    ) -> list[str]:
        """The command line of one test: `n_prompt` tokens in one batch of `batch` split into ubatches of
        `ubatch` (pp), or `n_gen` tokens one at a time after `depth` tokens of context (tg)."""
        flags = {"-p": n_prompt, "-n": n_gen, "-d": depth, "-b": batch, "-ub": ubatch, "-t": self.threads}
        return [self.binary, "-m", gguf, *(str(x) for kv in flags.items() for x in kv), "-r", str(reps), "-o", "json"]

    def run(self, gguf: str, **test: int) -> dict[str, Any]:
        """The row of one test (`command`'s settings)."""
        cmd = self.command(gguf, **test)
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"llama-bench failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}")
        (row,) = parse_llama_bench_json(done.stdout)
        return row


def add_llamacpp_args(parser: argparse.ArgumentParser) -> None:
    """--llama-bench (default: `make llamacpp-ref`'s native build where it exists), --llamacpp-gguf, --no-llamacpp."""
    group = parser.add_argument_group("llama.cpp (make llamacpp-ref)")
    default = default_llama_bench()
    group.add_argument(
        "--llama-bench",
        default=None if default is None else str(default),
        metavar="PATH",
        help=f"llama.cpp's llama-bench (default: {REF_DIR.name}/native/bin/llama-bench where it exists; "
        f"{REF_DIR.name}/avx2/bin/llama-bench is the AVX2-only build)",
    )
    group.add_argument(
        "--llamacpp-gguf",
        nargs="+",
        default=[],
        metavar="FORMAT=PATH",
        help=f"GGUF files of the same weights, FORMAT the engine's weight format each compares with "
        f"(default: {REF_DIR.name}/gguf/MODEL-{{f32,bf16,q8_0}}.gguf where they exist)",
    )
    group.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out")


def llamacpp_from_args(
    args: argparse.Namespace, command: str, weight_formats: Sequence[str]
) -> tuple[LlamaBench | None, dict[str, str]]:
    """The llama-bench and the GGUFs (the engine's weight format -> path, of `weight_formats` only) the command
    line asks for: none where --no-llamacpp is given or nothing is found; a named file that is not there, a format
    that is not the engine's, or GGUFs without a llama-bench fail naming the flag."""
    if args.no_llamacpp:
        return None, {}
    named = {}
    for spec in args.llamacpp_gguf:
        weights, sep, path = spec.partition("=")
        if not sep or not weights or not path:
            raise SystemExit(f"{command}: --llamacpp-gguf: expected FORMAT=PATH, got {spec!r}")
        if weights not in GGUF_TYPES:
            raise SystemExit(f"{command}: --llamacpp-gguf: FORMAT is one of {', '.join(GGUF_TYPES)}, got {weights!r}")
        if not os.path.isfile(path):
            raise SystemExit(f"{command}: --llamacpp-gguf: no such file {path!r}")
        named[weights] = path
    ggufs = {w: p for w, p in (named or default_ggufs(args.model)).items() if w in weight_formats}
    if args.llama_bench is None:
        if named:
            raise SystemExit(f"{command}: --llamacpp-gguf needs llama-bench: make llamacpp-ref, or --llama-bench PATH")
        return None, {}
    if not os.access(args.llama_bench, os.X_OK):
        raise SystemExit(f"{command}: --llama-bench: not an executable file {args.llama_bench!r}")
    import torch  # the engine's threads: both sides get as many

    return LlamaBench(args.llama_bench, torch.get_num_threads()), ggufs
