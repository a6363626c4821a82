"""Speculative decoding: output tokens per second with and without drafts, at batch 1 and 8, on an
input-grounded editing workload (the answer repeats the prompt: n-gram lookup helps) and on free chat.

Greedy decoding: with or without drafts the tokens are identical, so every configuration does the same useful
work and the speedup is a plain ratio of times. Methods: n-gram lookup, a draft model (by default the target
drafting for itself: every greedy draft is accepted, so it shows the mechanism's ceiling and the drafting cost), and
the learned heads EAGLE, EAGLE-3 and Medusa (the target's default heads, made by `workbench train-draft`), each as a
chain, as a draft tree and with a dynamic schedule (drafts only while the batch is small). Each row also gives the
draft's share of the run's time, and the load average around the runs (the machine may be shared).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from engine import LLM, RequestOutput, SamplingParams
from engine.spec_decode.tree import SpecTree
from workbench.bench.args import add_common_args, add_positive_ints, positive_int, run_with_flags
from workbench.bench.datasets import BenchRequest, chat_prompt_ids, editing_requests
from workbench.bench.report import Line, Part, Table, describe, docs_only, formatters
from workbench.bench.timing import LoadAverage, alternate, load_line

HELP = "speculative decoding: tokens/s with and without drafts, batch 1 and 8"
IN_ALL: tuple[int, list[str]] = (8, ["--runs", "2"])  # `workbench bench all` runs it: (place, flags)

_CHAT = (
    "Tell me about the history of tea.",
    "What makes a good teacher?",
    "Describe a walk in a forest.",
    "Why is the sky blue?",
    "Give advice to a new programmer.",
    "What is a black hole?",
    "Write a short story about a cat.",
    "How do bees make honey?",
)


def chat_requests(tokenizer, num_requests: int, output_len: int) -> list[BenchRequest]:
    return [
        BenchRequest(chat_prompt_ids(tokenizer, _CHAT[i % len(_CHAT)]), output_len, ignore_eos=False)
        for i in range(num_requests)
    ]


LEARNED = ("eagle", "eagle3", "medusa")  # the methods whose default heads are committed
DYNAMIC = ("ngram", *LEARNED)  # the drafters also measured with the dynamic schedule
METHODS = (
    "none",
    "ngram",
    "draft_model",
    *LEARNED,
    *(f"{m}_tree" for m in LEARNED),
    *(f"{m}_dynamic" for m in DYNAMIC),
)
# the draft tree of the *_tree methods (vLLM's speculative_token_tree): three children of the root, two of the first,
# one of the second, one below the best path's second node: 7 nodes, depth 3
TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"
TREE_NODES = len(SpecTree.parse(TREE))


# the *_dynamic methods' num_speculative_tokens_per_batch_size: k drafts while one or two requests run, none from
# three on, where verifying k more rows per request costs more than the accepted drafts save (docs/BENCHMARKS.md)
def dynamic_schedule(k: int) -> list[tuple[int, int, int]]:
    return [(1, 2, k), (3, 1 << 20, 0)]  # the last range reaches any max_num_seqs


def methods(k: int, draft_model: str, names: Sequence[str] = METHODS) -> dict[str, dict | None]:
    configs: dict[str, dict | None] = {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 5, "prompt_lookup_min": 2},
        "draft_model": {"method": "draft_model", "model": draft_model, "num_speculative_tokens": k},
        # no "model": the target's default head
        **{method: {"method": method, "num_speculative_tokens": k} for method in LEARNED},
        **{
            f"{method}_tree": {"method": method, "num_speculative_tokens": TREE_NODES, "speculative_token_tree": TREE}
            for method in LEARNED
        },
    }
    for method in DYNAMIC:
        configs[f"{method}_dynamic"] = {
            **(configs[method] or {}),
            "num_speculative_tokens_per_batch_size": dynamic_schedule(k),
        }
    return {name: configs[name] for name in ("none", *names) if name in configs}


def cache_blocks(
    workloads: Iterable[Sequence[BenchRequest]], batch_sizes: Iterable[int], lookahead: int, block_size: int
) -> int:
    """KV blocks for the largest batch of any workload at its full length plus `lookahead` draft slots per request,
    and the null block: a batch's requests run together, each batch after the last has finished."""
    need = 0
    for requests in workloads:
        for bs in batch_sizes:
            for i in range(0, len(requests), bs):
                batch = requests[i : i + bs]
                need = max(
                    need, sum(-(-(len(r.prompt_token_ids) + r.output_len + lookahead) // block_size) for r in batch)
                )
    return need + 1


def _generate(llm: LLM, batch: Sequence[BenchRequest]) -> Callable[[], list[RequestOutput]]:
    """A call that runs one batch of requests together on `llm` (its arguments made now, outside any timing)."""
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=r.ignore_eos) for r in batch]
    return partial(llm.generate, [r.prompt_token_ids for r in batch], params, use_tqdm=False)


def _run_in_turns(
    llms: dict[str, LLM], requests: Sequence[BenchRequest], batch_size: int
) -> tuple[dict[str, float], dict[str, list[list[int]]]]:
    """The requests in consecutive batches, each batch through every engine in turn; seconds and tokens per engine.
    Taking turns batch by batch, a slow spell of this shared host (its runs of one engine have differed by 20%)
    falls on every method, not on whichever one was running all its batches then."""
    seconds = dict.fromkeys(llms, 0.0)
    tokens: dict[str, list[list[int]]] = {name: [] for name in llms}
    for llm in llms.values():
        llm.engine.reset_prefix_cache()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        for turn in alternate({name: _generate(llm, batch) for name, llm in llms.items()}, runs=1):
            seconds[turn.side] += turn.seconds
            tokens[turn.side] += [o.token_ids for o in turn.value]
    return seconds, tokens


def run_spec(
    model: str = "smollm2-135m",
    k: int = 4,
    draft_model: str | None = None,
    batch_sizes=(1, 8),
    num_requests: int = 8,
    output_len: int = 96,
    runs: int = 2,
    seed: int = 0,
    max_num_batched_tokens: int = 2048,
    engine_kwargs: dict[str, Any] | None = None,
    methods_: Sequence[str] = METHODS,
    workloads_: Sequence[str] = ("editing", "chat"),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Median seconds per (workload, batch size, method), the methods taking turns batch by batch; acceptance
    statistics and the proposer's time from the engines' SpecDecodingStats; the load average before the first run
    and after the last."""
    configs = methods(k, draft_model or model, methods_)
    engine_kwargs = dict(engine_kwargs or {})

    def engine(cfg: dict | None, **cache: int) -> LLM:
        return LLM(
            model=model,
            seed=seed,
            speculative_config=cfg,
            max_num_batched_tokens=max_num_batched_tokens,
            **{**cache, **engine_kwargs},
        )

    llms = {"none": engine(configs["none"])}
    tok = llms["none"].tokenizer
    editing = [
        BenchRequest(r.prompt_token_ids, min(r.output_len, output_len), ignore_eos=False)
        for r in editing_requests(num_requests, tok, seed=seed)
    ]
    workloads = {
        name: w
        for name, w in (("editing", editing), ("chat", chat_requests(tok, num_requests, output_len)))
        if name in workloads_
    }
    # Every engine is alive at once, taking turns: at the default 1 GiB of cache each, the 13 methods held 17 GB
    # (the out-of-memory kill of a CI run). The drafting engines get the blocks their largest batch can use; the
    # cache's size does not enter a step's time (the "none" engine, built first to read the prompts, keeps its own).
    block_size = llms["none"].engine.config.block_size
    cache = (
        {}
        if {"num_kv_blocks", "kv_cache_memory"} & engine_kwargs.keys()
        else {"num_kv_blocks": cache_blocks(workloads.values(), batch_sizes, max(k, TREE_NODES) + 1, block_size)}
    )
    llms |= {name: engine(cfg, **cache) for name, cfg in configs.items() if name != "none"}
    times: dict[tuple, list[float]] = {}
    results: dict[tuple, dict] = {}
    load = LoadAverage()
    for run in range(runs):
        for wname, requests in workloads.items():
            for bs in batch_sizes:
                before = {name: _stats(llm) for name, llm in llms.items()}
                seconds, tokens = _run_in_turns(llms, requests, bs)
                for name, llm in llms.items():
                    if tokens[name] != tokens["none"]:
                        raise RuntimeError(f"{name}: greedy tokens differ from the run without speculation")
                    num_tokens = sum(len(t) for t in tokens[name])
                    times.setdefault((wname, bs, name), []).append(seconds[name])
                    results[(wname, bs, name)] = {
                        "output_tokens": num_tokens,
                        **_delta(before[name], _stats(llm), seconds[name]),
                    }
                    log(f"run {run + 1}/{runs} {wname} batch {bs} {name}: {seconds[name]:.2f} s, {num_tokens} tokens")
    rows = []
    for (wname, bs, name), r in results.items():
        median = statistics.median(times[(wname, bs, name)])
        base = statistics.median(times[(wname, bs, "none")])
        rows.append(
            {
                "workload": wname,
                "batch": bs,
                "method": name,
                "seconds": median,
                "tok_s": r["output_tokens"] / median,
                "speedup": base / median,
                **r,
            }
        )
    return {
        "model": model,
        "k": k,
        "draft_model": draft_model or model,
        "runs": runs,
        "rows": rows,
        "load_average": load.done(),
        "heads": _heads(llms),
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    parser.add_argument("--k", type=positive_int, default=4, help="draft tokens per step (default: %(default)s)")
    parser.add_argument("--draft-model", default=None, help="the draft model (default: the target itself)")
    add_positive_ints(parser, num_requests=8, output_len=96)
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS[1:],
        default=list(METHODS[1:]),
        help="the speculative methods beside none (default: all)",
    )
    parser.add_argument("--workloads", nargs="+", choices=("editing", "chat"), default=["editing", "chat"])


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench spec`: run_spec with the command line's settings."""
    return run_with_flags(run_spec, args, methods_=args.methods, workloads_=args.workloads)


def _stats(llm: LLM) -> tuple:
    """Drafts verified, draft tokens, accepted tokens, proposer seconds; drafted and accepted by depth (a chain's
    position) and by branch (a tree node's child index under its parent)."""
    s = llm.engine.spec_stats
    if s is None:
        return (0, 0, 0, 0.0, [], [], [], [])
    return (
        s.num_drafts,
        s.num_draft_tokens,
        s.num_accepted_tokens,
        s.proposer_seconds,
        list(s.drafted_per_position),
        list(s.accepted_per_position),
        list(s.drafted_per_branch),
        list(s.accepted_per_branch),
    )


def _rates(drafted_after: list[int], drafted_before: list[int], accepted_after: list[int], accepted_before: list[int]):
    """Acceptance at each depth (or branch) over the run: accepted / drafted there."""

    def diff(after: list[int], before: list[int]) -> list[int]:
        return [a - (before[i] if i < len(before) else 0) for i, a in enumerate(after)]

    drafted, accepted = diff(drafted_after, drafted_before), diff(accepted_after, accepted_before)
    return [(accepted[i] if i < len(accepted) else 0) / n if n else 0.0 for i, n in enumerate(drafted)]


def _delta(before: tuple, after: tuple, seconds: float) -> dict[str, Any]:
    drafts, drafted, accepted, drafting = (a - b for a, b in zip(after[:4], before[:4]))
    return {
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "draft_share": drafting / seconds if seconds else 0.0,
        "acceptance_by_depth": _rates(after[4], before[4], after[5], before[5]),
        "acceptance_by_branch": _rates(after[6], before[6], after[7], before[7]),
    }


def _rate_list(rates: list[float]) -> str:
    return " ".join(f"{r:.0%}" for r in rates) or "-"


def _heads(llms: dict[str, LLM]) -> dict[str, str]:
    """The head folder each learned method used (its manifest says how it was made), from the repository's root
    when it is one of the committed heads."""
    from engine.spec_decode.draft_heads import head_path

    root = Path(__file__).resolve().parents[2]
    heads: dict[str, str] = {}
    for name in LEARNED:
        if any(run.split("_")[0] == name for run in llms):
            folder = head_path(None, next(iter(llms.values())).engine.config.model, name).resolve()
            heads[name] = str(folder.relative_to(root) if folder.is_relative_to(root) else folder)
    return heads


_HEADERS = (
    "workload",
    "batch",
    "method",
    "median s",
    "output tok/s",
    "speedup",
    "acceptance",
    "tokens/verify",
    "draft share",
    "by depth",
    "by branch",
)


def _table_rows(result: dict[str, Any]) -> list[list[object]]:
    return [
        [
            r["workload"],
            r["batch"],
            r["method"],
            r["seconds"],
            r["tok_s"],
            f"{r['speedup']:.2f}x",
            f"{r['acceptance_rate']:.0%}" if r["method"] != "none" else "-",
            r["mean_acceptance_length"] if r["method"] != "none" else "-",
            f"{r.get('draft_share', 0.0):.0%}" if r["method"] != "none" else "-",
            _rate_list(r.get("acceptance_by_depth", [])) if r["method"] != "none" else "-",
            _rate_list(r.get("acceptance_by_branch", [])) if r["method"] != "none" else "-",
        ]
        for r in result["rows"]
    ]


_DOCS = (
    "Model {model}, fp32, greedy (identical tokens with and without drafts: checked), k={k} draft tokens; n-gram "
    "lookup windows 5..2; draft model {draft_model} (drafting for itself accepts every greedy draft: the ceiling "
    "of the mechanism, paying a full draft forward per token); *_tree: a 7-node tree of depth 3 ({tree}); "
    "*_dynamic: k drafts while a step runs 1 or 2 requests, none from 3 on (num_speculative_tokens_per_batch_size). "
    "Batch 1: every request alone, one after "
    "another; batch 8: eight together. The methods take turns batch by batch (each batch runs through "
    "every method before the next batch). Median of {runs} runs. Editing prompts ask to rewrite a code "
    "passage (input-grounded); chat prompts are free questions. Speedup below 1x is a slowdown. EAGLE and "
    "Medusa: the target's default heads ({heads}; each folder's manifest.json says how it was made). Draft "
    "share: the proposer's time over the run's. By depth: the acceptance at each draft position (a tree's depth: "
    "accepted when the kept path reaches it); by branch: a tree's nodes by child index under their parent (0: "
    "the best choice), accepted over drafted (none for a chain)."
)


def _parts(result: dict[str, Any]) -> list[Part]:
    values = {
        "heads": ", ".join(f"{m}: {p}" for m, p in result.get("heads", {}).items()) or "none run",
        "tree": TREE,
    }
    return [docs_only(describe(_DOCS, result, **values)), Table(_HEADERS, _table_rows(result)), Line(load_line(result))]


format_text, format_markdown = formatters("Speculative decoding", _parts)
