"""The real model across processes: a PDCluster (1 prefill + 1 decode process) streams the same greedy tokens as a
single engine, through both stores."""

from __future__ import annotations

import pytest

from engine import LLM, PDCluster, SamplingParams

pytestmark = pytest.mark.slow

KW = dict(block_size=16, num_kv_blocks=64, max_model_len=512)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPTS = [
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
    "The three largest cities of France are",
]


@pytest.fixture(scope="module")
def want(smollm2_path):
    return LLM(model="smollm2-135m", **KW).generate(PROMPTS, GREEDY, use_tqdm=False)


@pytest.fixture(scope="module", params=["shared_storage", "redis"])
def cluster(request, smollm2_path):
    if request.param == "redis":
        request.getfixturevalue("redis_server")  # skips where redis-server is missing
    with PDCluster(model="smollm2-135m", connector=request.param, **KW) as c:
        yield c


def test_smollm2_cluster_streams_the_single_engine_tokens(cluster, want) -> None:
    streamed: dict[str, list[int]] = {}
    for delta in cluster.generate_stream(PROMPTS, GREEDY):
        streamed.setdefault(delta.request_id, []).extend(delta.token_ids)
    outs = [cluster.pop_output(rid) for rid in sorted(streamed, key=lambda r: int(r.split("-")[1]))]
    assert [o.token_ids for o in outs] == [streamed[o.request_id] for o in outs] == [w.token_ids for w in want]
    assert [o.text for o in outs] == [w.text for w in want] and all(w.text.strip() for w in want)
    records = cluster.records()
    loads = [e for r in records["decode-0"] for e in r.of_kind("kv_transfer.load")]
    assert {e.remote_request_id for e in loads} == set(streamed) and all(e.num_bytes > 0 for e in loads)
