"""Connectors in one process, over both stores: a producer engine prefills, a consumer engine loads and decodes.
Outputs must equal a single engine's; every failure goes by the policy; no block leaks."""

from __future__ import annotations

import json
import os
import signal
import time
from types import SimpleNamespace

import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.kv_transfer.shared_storage import ExampleConnector, SharedStorageConnector
from engine.kv_transfer.store_connector import prompt_key
from engine.request import Request

KW = dict(model="tiny-llama", block_size=16, num_kv_blocks=64, max_model_len=512)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
PREFILL = SamplingParams(temperature=0.0, max_tokens=1)
PROMPTS = [
    "The capital of France is a city of light, of river banks and of long avenues where",
    "Once upon a time",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(**KW)


@pytest.fixture(scope="module")
def engines(kv_config) -> SimpleNamespace:
    return SimpleNamespace(
        producer=LLMEngine(**KW, kv_transfer_config=kv_config("kv_producer")),
        consumer=LLMEngine(**KW, kv_transfer_config=kv_config("kv_consumer")),
        consumer_fail=LLMEngine(**KW, kv_transfer_config=kv_config("kv_consumer", "fail")),
        kind=kv_config.connector,
    )


def run(engine: LLMEngine, prompts, params, kv_params=None):
    kv_params = kv_params or [None] * len(prompts)
    ids = [engine.add_request(p, params, kv_transfer_params=k) for p, k in zip(prompts, kv_params)]
    records = []
    while engine.has_unfinished_requests():
        records.append(engine.step())
    return [engine.pop_output(i) for i in ids], records


def prefill(engine: LLMEngine, prompts) -> list[dict]:
    outs, _ = run(engine, prompts, PREFILL, [{"do_remote_decode": True}] * len(prompts))
    assert all(o.kv_transfer_params and o.kv_transfer_params["do_remote_prefill"] for o in outs)
    return [o.kv_transfer_params for o in outs]


def events(records, kind):
    return [e for r in records for e in r.of_kind(kind)]


def assert_same(outs, want) -> None:
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    for o, w in zip(outs, want):  # logprobs see every KV value the decode read
        for a, b in zip(o.logprobs, w.logprobs):
            assert list(a) == list(b) and all(abs(a[t] - b[t]) < 1e-4 for t in a)


def assert_no_leaks(*engs: LLMEngine) -> None:
    for e in engs:
        assert e.kv_cache_manager.usage().used == 0


def test_consumer_loads_the_kv_and_matches_a_single_engine(engines, reference) -> None:
    want = reference.generate(PROMPTS, GREEDY, use_tqdm=False)
    params = prefill(engines.producer, PROMPTS)
    outs, records = run(engines.consumer, PROMPTS, GREEDY, params)
    assert_same(outs, want)
    assert all(o.finish_reason == "length" for o in outs)
    first = records[0]
    assert set(first.scheduled.values()) == {1}  # only each prompt's last token is computed
    loads = first.of_kind("kv_transfer.load")
    assert sorted(e.num_tokens for e in loads) == sorted(len(o.prompt_token_ids) - 1 for o in outs)
    assert all(e.num_bytes > 0 and e.remote_request_id is not None for e in loads)
    assert_no_leaks(engines.producer, engines.consumer)


def test_missing_kv_is_recomputed_to_the_same_tokens(engines, reference) -> None:
    prompt = ["A prompt that no producer has ever seen, long enough for two blocks of KV."]
    outs, records = run(engines.consumer, prompt, GREEDY, [{"do_remote_prefill": True}])
    assert_same(outs, reference.generate(prompt, GREEDY, use_tqdm=False))
    (fail,) = events(records, "kv_transfer.fail")
    assert (fail.failure, fail.policy_action) == ("missing", "recompute")
    assert not events(records, "kv_transfer.load")
    assert_no_leaks(engines.consumer)


def test_missing_kv_fails_the_request_by_policy(engines) -> None:
    prompts = ["Another prompt nobody prefilled for us, here.", "Once upon a time"]
    outs, records = run(engines.consumer_fail, prompts, GREEDY, [{"do_remote_prefill": True}, None])
    assert outs[0].finish_reason == "error" and "kv_transfer" in outs[0].error and outs[0].token_ids == []
    assert outs[1].finish_reason == "length"  # the others go on
    assert events(records, "kv_transfer.fail")[0].policy_action == "fail"
    assert_no_leaks(engines.consumer_fail)


def damage(connector, key: str, layer: int, how: str) -> None:
    """Flip bytes of one layer's V in block 1 (of 3), or remove the layer, in whichever store."""
    manifest = connector._get_manifest(key)
    blob = bytearray(connector._get_layer(key, manifest, layer))
    header_len = int.from_bytes(blob[:8], "little")
    start, end = json.loads(blob[8 : 8 + header_len])["value"]["data_offsets"]
    at = 8 + header_len + start + (end - start) // 3 + 4  # a few bytes into block 1
    blob[at : at + 4] = bytes(b ^ 0xFF for b in blob[at : at + 4])
    if isinstance(connector, ExampleConnector):
        path = connector.entry(key) / f"layer_{layer:03d}.safetensors"
        path.unlink() if how == "missing" else path.write_bytes(bytes(blob))
        return
    keys = [connector._k(key, f"L{layer}:{c}") for c in range(manifest["chunks"][layer])]
    if how == "missing":
        connector.client.delete(keys[-1])
    else:
        offset = (len(keys) - 1) * connector.chunk_bytes
        connector.client.set(keys[-1], bytes(blob[offset:]), keepttl=True)


@pytest.mark.parametrize("how", ["corrupt", "missing"])
def test_partial_or_corrupt_kv_goes_by_the_policy(engines, reference, how) -> None:
    prompt = [[1000 + 7 * i + (how == "missing") for i in range(40)]]  # three blocks, the last one partial
    for consumer in (engines.consumer, engines.consumer_fail):
        params = prefill(engines.producer, prompt)
        damage(engines.producer.connector, params[0]["remote_key"], 1, how)
        outs, records = run(consumer, prompt, GREEDY, params)
        (fail,) = events(records, "kv_transfer.fail")
        assert fail.failure == how
        n = len(outs[0].prompt_token_ids)
        if consumer is engines.consumer:
            assert_same(outs, reference.generate(prompt, GREEDY, use_tqdm=False))
            # a bad block is recomputed from its start on; a missing layer costs every loaded block
            assert fail.num_recomputed_tokens == (n - 1 - 16 if how == "corrupt" else n - 1)
            # the step whose load failed withdrew the request; the next one recomputes it as a prefill
            rid = outs[0].request_id
            assert [r.phases[rid] for r in records if rid in r.phases][0] == "prefill"
        else:
            assert outs[0].finish_reason == "error" and fail.policy_action == "fail"
        assert_no_leaks(consumer)
        _drop(engines.producer.connector, params[0]["remote_key"])


def _drop(connector, key: str) -> None:
    if isinstance(connector, ExampleConnector):
        import shutil

        shutil.rmtree(connector.entry(key))
    else:
        connector.client.delete(*connector.client.keys(connector._k(key, "*")))


def test_model_dtype_or_block_size_mismatch_is_a_miss_never_a_false_hit(engines, kv_config, reference) -> None:
    prompt = ["Mismatch check: the same prompt, prefilled by an engine with other settings."]
    params = prefill(engines.producer, prompt)
    other = LLMEngine(**{**KW, "block_size": 32}, kv_transfer_config=kv_config("kv_consumer"))
    outs, records = run(other, prompt, GREEDY, params)
    assert not events(records, "kv_transfer.load")
    assert events(records, "kv_transfer.fail")[0].failure == "missing"  # another namespace: not even seen
    assert_same(outs, reference.generate(prompt, GREEDY, use_tqdm=False))
    wrong = {**params[0], "remote_key": "00" * 32}  # the producer's key does not match this prompt
    outs, records = run(engines.consumer, prompt, GREEDY, [wrong])
    assert events(records, "kv_transfer.fail")[0].failure == "mismatch" and not events(records, "kv_transfer.load")
    assert_no_leaks(other, engines.consumer)


def test_the_same_kv_written_twice_is_idempotent(engines) -> None:
    prompt = ["Idempotence: this prompt is prefilled twice by the same producer."]
    _, first = run(engines.producer, prompt, PREFILL, [{"do_remote_decode": True}])
    _, second = run(engines.producer, prompt, PREFILL, [{"do_remote_decode": True}])
    (save1,), (save2,) = events(first, "kv_transfer.save"), events(second, "kv_transfer.save")
    assert save1.key == save2.key and save1.num_bytes > 0 and save2.num_bytes == 0
    probe = Request("probe", engines.producer.tokenizer.encode(prompt[0], add_special_tokens=False), PREFILL, None)
    manifest = engines.producer.connector._get_manifest(prompt_key(probe, 16))
    assert manifest["producer"]["request_id"] == save1.request_id  # the first copy stays


def test_a_paused_store_times_out_then_the_policy_applies(engines, kv_config, reference, request) -> None:
    if kv_config.connector != "redis":
        pytest.skip("a shared folder cannot be paused")
    pid = request.getfixturevalue("redis_server").proc.pid
    prompt = ["While the store sleeps, decode goes on by recomputing."]
    params = prefill(engines.producer, prompt)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        outs, records = run(engines.consumer, prompt, GREEDY, params)
        elapsed = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert elapsed < 5  # the client's timeout_s is 0.5
    assert events(records, "kv_transfer.fail")[0].failure == "timeout"
    assert_same(outs, reference.generate(prompt, GREEDY, use_tqdm=False))
    assert_no_leaks(engines.consumer)


@pytest.mark.parametrize(
    "cfg, exc, field",
    [
        ({"kv_connector": "nixl", "kv_role": "kv_both"}, ValueError, "kv_connector"),
        ({"kv_connector": "redis", "kv_role": "both"}, ValueError, "kv_role"),
        (
            {"kv_connector": "redis", "kv_role": "kv_both", "kv_load_failure_policy": "retry"},
            ValueError,
            "kv_load_failure_policy",
        ),
        ({"kv_connector": "redis", "kv_role": "kv_both", "kv_buffer_size": 1}, ValueError, "kv_buffer_size"),
        (
            {"kv_connector": "redis", "kv_role": "kv_both", "kv_connector_extra_config": 3},
            TypeError,
            "kv_connector_extra_config",
        ),
    ],
)
def test_bad_kv_transfer_config_names_the_field(cfg, exc, field) -> None:
    with pytest.raises(exc, match=field):
        EngineConfig(kv_transfer_config=cfg)


def test_a_connector_without_its_store_setting_names_it() -> None:
    with pytest.raises(ValueError, match="shared_storage_path"):
        LLMEngine(**KW, kv_transfer_config={"kv_connector": "shared_storage", "kv_role": "kv_both"})


def test_stored_kv_nobody_loads_expires_after_the_lease(kv_config) -> None:
    # a decode instance killed before its load leaves the KV behind: the lease (ttl_s) bounds how long it stays
    producer = LLMEngine(**KW, kv_transfer_config=kv_config("kv_producer", ttl_s=1))
    (left,) = prefill(producer, ["KV for a decode instance that was killed before it came for it."])
    assert producer.connector._get_manifest(left["remote_key"]) is not None
    time.sleep(1.2)
    (kept,) = prefill(producer, ["A later prompt, stored after the first one's lease ran out."])
    assert producer.connector._get_manifest(left["remote_key"]) is None
    assert producer.connector._get_manifest(kept["remote_key"]) is not None
    assert_no_leaks(producer)


def test_a_stopped_store_fails_saves_and_loads_by_the_policy(kv_config, reference) -> None:
    if kv_config.connector != "redis":
        pytest.skip("a shared folder cannot be stopped")
    from engine.kv_transfer.redis_server import RedisServer

    prompt = ["The store went away between the prefill and the decode; the decode recomputes."]
    server = RedisServer().start()
    extra = {"url": server.url, "timeout_s": 0.5}
    producer = LLMEngine(**KW, kv_transfer_config=kv_config("kv_producer", **extra))
    consumer = LLMEngine(**KW, kv_transfer_config=kv_config("kv_consumer", **extra))
    params = prefill(producer, prompt)
    server.stop()
    outs, records = run(consumer, prompt, GREEDY, params)
    assert events(records, "kv_transfer.fail")[0].failure == "store_error"
    assert_same(outs, reference.generate(prompt, GREEDY, use_tqdm=False))
    # a save into a stopped store: a fail event, no kv_transfer_params, and the request itself is fine
    outs, records = run(producer, ["Saved into nothing."], PREFILL, [{"do_remote_decode": True}])
    (fail,) = events(records, "kv_transfer.fail")
    assert fail.failure == "save_error" and outs[0].finish_reason == "length" and outs[0].kv_transfer_params is None
    assert_no_leaks(producer, consumer)


def test_the_article_s_connector_name_is_vllm_0_33_s_example_connector():
    from engine.config import KVTransferConfig

    for name in ("SharedStorageConnector", "ExampleConnector", "shared_storage"):
        assert (
            KVTransferConfig.from_dict({"kv_connector": name, "kv_role": "kv_both"}).kv_connector == "ExampleConnector"
        )
    assert SharedStorageConnector is ExampleConnector and ExampleConnector.name == "ExampleConnector"
