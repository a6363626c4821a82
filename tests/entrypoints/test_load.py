"""Load held (issue #39), the smaller burst `make test` runs: 16 concurrent streams, a third of them cut mid-stream by
the client, malformed requests in the same burst (workbench/bench/http_serve.py's bad client, which `workbench bench
serve --chaos-*` uses too). Every stream that finished ends with `data: [DONE]` and its greedy text equals a
sequential run's; every malformed request gets a 4xx; /health answers throughout; nothing is lost and no KV block
leaks."""

from __future__ import annotations

import random

from engine import SamplingParams
from tests.entrypoints.conftest import MODEL
from workbench.bench.datasets import BenchRequest
from workbench.bench.http_serve import Chaos, run_http_serve_once

NUM_STREAMS = 16


def test_a_burst_with_cuts_and_malformed_requests_loses_nothing(served, offline):
    rng = random.Random(7)
    words = ["paged", "blocks", "tokens", "budget", "prefix", "cache", "decode", "batch", "queue", "step"]
    prompts = [
        f"Stream {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(2, 10))) for i in range(NUM_STREAMS)
    ]
    ids = [offline.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    # the sequential run: one request at a time, nothing beside it
    expected = [
        offline.generate([p], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].text for p in ids
    ]
    chaos = Chaos(disconnect=1 / 3, malformed=0.5, seed=3)
    requests = [BenchRequest(p, 16, ignore_eos=False) for p in ids]
    streamed, _, seen = run_http_serve_once(f"{served.base_url}/v1", MODEL, requests, [0.0] * NUM_STREAMS, chaos=chaos)

    cut = chaos.cuts(NUM_STREAMS)
    assert len(cut) == 5 and seen.requests["cut"] >= 1, seen.to_dict()
    for i, (outcome, text) in enumerate((s.outcome, s.text) for s in streamed):
        if i in cut and outcome == "cut":
            assert expected[i].startswith(text), i  # what it read before leaving was right
        else:  # a stream the client read to its end: [DONE], and the text of the sequential run
            assert outcome == "done" and text == expected[i], (i, outcome, text, expected[i])
    assert sum(seen.malformed.values()) == 8 and all(s.startswith("4") for s in seen.malformed), seen.malformed
    assert seen.lost == 0 and seen.health_failed == 0 and seen.health_ok >= 1, seen.to_dict()
    assert seen.left == {"running": 0, "waiting": 0, "kv_cache_usage_perc": 0}
    stats = served.llm.stats()
    assert (stats["num_running"], stats["num_waiting"], stats["kv"].used) == (0, 0, 0)
    assert served.llm.wait_until_idle(30) and not served.llm._collectors and not served.llm._parent_of
