"""`workbench bench decode`: every side decodes the same prompt to the same number of tokens, the fast weight
formats beside float32, transformers beside the engine; bad flags name themselves (llama.cpp's rows:
test_llamacpp.py)."""

from __future__ import annotations

import pytest

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
