"""`workbench bench decode`: every side decodes the same prompt to the same number of tokens, the fast weight
formats beside float32, transformers beside the engine; bad flags name themselves (llama.cpp's rows:
test_llamacpp.py)."""

from __future__ import annotations

import pytest

from engine.outputs import RequestMetrics, RequestOutput
from workbench.bench import decode
from workbench.cli import main


def test_each_side_decodes_and_the_float32_sides_agree_on_the_tokens():
    result = decode.run_decode(model="tiny-llama", max_tokens=6, runs=2, log=lambda _: None)
    rows = {(r["system"], r["weights"]): r for r in result["rows"]}
    assert set(rows) == {
        ("engine", "float32"),
        ("engine", "bfloat16"),
        ("engine", "int8"),
        ("transformers generate", "float32"),
        ("transformers generate", "bfloat16"),
    }
    assert all(len(r["runs"]) == 2 and r["tok_s"] > 0 for r in rows.values())
    # the engine times its decode steps apart from its prefill (what llama-bench's tg rate is); transformers cannot
    engine = rows[("engine", "float32")]
    assert len(engine["decode_runs"]) == 2 and engine["decode_tok_s"] > 0
    assert "decode_tok_s" not in rows[("transformers generate", "float32")]
    assert rows[("transformers generate", "float32")]["same_tokens_as_engine_fp32"] is True  # greedy == HF
    assert set(result["load_average"]) == {"before", "after"}
    assert "vs transformers fp32" in decode.format_text(result)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("int8", "expected FORMAT=PATH, got 'int8'"),
        ("int8=/nonexistent.gguf", "no such file '/nonexistent.gguf'"),
        ("q8_0=/nonexistent.gguf", "FORMAT is one of float32, bfloat16, int8, got 'q8_0'"),
    ],
)
def test_a_bad_gguf_flag_names_itself(spec, message):
    with pytest.raises(SystemExit, match=f"bench decode: --llamacpp-gguf: {message}"):
        main(["bench", "decode", "--model", "tiny-llama", "--llamacpp-gguf", spec])


def test_the_engine_decode_rate_counts_the_tokens_after_its_first_over_their_time():
    """What the engine / llama.cpp column divides: llama-bench's tg times decode steps alone, after its context."""
    metrics = RequestMetrics(arrival_time=0.0, first_token_time=1.0, last_token_time=3.0)
    out = RequestOutput("r", [7], [1, 2, 3, 4, 5], "", "length", metrics=metrics)
    assert decode.engine_decode_rate(out) == 2.0  # 4 tokens after the first in the 2 s between the first and last
