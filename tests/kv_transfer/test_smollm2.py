"""The real model through both stores: one kv_both engine (prefix caching off, so only the store can supply KV)
saves a prompt's KV, then loads it back and decodes; tokens and logprobs equal a plain run's."""

from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)
PROMPT = (
    "<|im_start|>user\nExplain in two sentences why the sky is blue, and why sunsets are red.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _run(engine: LLMEngine, params: SamplingParams, kv_params: dict | None):
    rid = engine.add_request(PROMPT, params, kv_transfer_params=kv_params)
    records = []
    while engine.has_unfinished_requests():
        records.append(engine.step())
    return engine.pop_output(rid), records


@pytest.fixture(scope="module")
def engine(kv_config, smollm2_path) -> LLMEngine:
    return LLMEngine(
        model="smollm2-135m",
        block_size=16,
        num_kv_blocks=64,
        enable_prefix_caching=False,
        kv_transfer_config=kv_config("kv_both"),
    )


def test_smollm2_decode_from_transferred_kv_equals_a_plain_run(engine) -> None:
    plain, _ = _run(engine, GREEDY, None)
    prefilled, saved = _run(engine, SamplingParams(temperature=0.0, max_tokens=1), {"do_remote_decode": True})
    (save,) = [e for r in saved for e in r.of_kind("kv_transfer.save")]
    loaded, records = _run(engine, GREEDY, prefilled.kv_transfer_params)
    (load,) = records[0].of_kind("kv_transfer.load")
    assert records[0].scheduled == {loaded.request_id: 1}
    assert load.num_tokens == len(plain.prompt_token_ids) - 1 and save.num_bytes == load.num_bytes > 0
    assert loaded.token_ids == plain.token_ids and plain.text.strip()
    for a, b in zip(loaded.logprobs, plain.logprobs):
        assert list(a) == list(b) and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert engine.kv_cache_manager.usage().used == 0
