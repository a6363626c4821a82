"""`workbench bench torch_compile`: its flags reach the run, and each side's forward is the one the model calls
(checked without compiling: `torch.compile` only wraps, and compiles on the first call); and the model's forward,
C++ ops included, traces into one graph with no break (dynamo's own trace with fullgraph=True, no code generated:
inductor on tiny-llama took over a minute on these 2 shared cores)."""

from __future__ import annotations

import functools

import pytest
import torch

import kernels
from engine import LLM, SamplingParams
from kernels.cpu.build import available
from workbench.bench import torch_compile
from workbench.cli import main


def test_the_flags_reach_the_run(monkeypatch):
    seen = {}

    @functools.wraps(torch_compile.run_torch_compile)  # its signature: run_with_flags passes what it names
    def run(**kwargs):
        seen.update(kwargs)
        return {"model": kwargs["model"], "rows": []}

    monkeypatch.setattr(torch_compile, "run_torch_compile", run)
    monkeypatch.setattr(torch_compile, "format_text", lambda result: "")
    argv = ["bench", "torch_compile", "--model", "tiny-llama", "--modes", "default", "--weights", "int8"]
    argv += ["--batch", "8", "--prompt-len", "16", "--steps", "2", "--max-tokens", "5", "--check-tokens", "3"]
    assert main([*argv, "--runs", "2"]) == 0
    assert {k: seen[k] for k in ("model", "modes", "weights", "batch", "prompt_len", "steps", "runs")} == {
        "model": "tiny-llama",
        "modes": ["default"],
        "weights": "int8",
        "batch": 8,
        "prompt_len": 16,
        "steps": 2,
        "runs": 2,
    }
    assert (seen["max_tokens"], seen["check_tokens"]) == (5, 3)


def test_a_mode_torch_compile_has_no_cpu_side_for_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "torch_compile", "--modes", "reduce-overhead"])  # CUDA graphs
    assert "invalid choice: 'reduce-overhead'" in capsys.readouterr().err


def test_each_side_makes_the_model_call_its_own_forward():
    llm = LLM(model="tiny-llama", seed=0)
    model = llm.engine.runner.model
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eager_tokens = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids
    forwards = torch_compile.Forwards(llm, ["default", "max-autotune-no-cudagraphs"])
    calls = []
    for name in ("default", "max-autotune-no-cudagraphs"):
        forwards.use(name)
        assert model.forward is forwards.forwards[name] and model.forward is not forwards.forwards["eager"]
        # the engine calls whatever forward is in place: a stand-in records the call and runs eager
        forwards.forwards[name] = lambda *args, name=name: calls.append(name) or forwards.forwards["eager"](*args)
        forwards.use(name)
        assert llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids == eager_tokens
    steps = calls.count("default")  # each side's run called its own forward at every step, the other's never
    assert steps >= 1 and calls == ["default"] * steps + ["max-autotune-no-cudagraphs"] * steps
    forwards.use("eager")
    assert model.forward == forwards.forwards["eager"]
    assert llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids == eager_tokens and len(calls) == 2 * steps


@pytest.mark.skipif(not available(), reason="the C++ CPU ops are not built here (no compiler?)")
def test_the_forward_traces_whole_through_the_cpu_ops_and_makes_eagers_tokens():
    """fullgraph=True makes any graph break an error: the C++ ops need their fake kernels and the kernel dispatch
    must not resolve under trace. The steps run the fused decoder stack, then (FUSED_LAYERS off) the layers' ops one
    by one, a prompt longer than SMALL_M through the float32 GEMM: both traced, both making eager's tokens."""
    llm = LLM(model="tiny-llama", seed=0)
    model = llm.engine.runner.model
    prompts = [[1, 2, 3], list(range(10, 40))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eager = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    fused = []
    fused_op = kernels._impl("llama_decoder_layers", "cpu")
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager", dynamic=False)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(kernels._IMPLS, ("llama_decoder_layers", "cpu"), lambda *a: fused.append(1) or fused_op(*a))
            compiled = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
            assert fused  # the fused op was traced (its fake) and run
            fused.clear()
            patch.setattr(kernels, "FUSED_LAYERS", False)
            one_by_one = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
            assert not fused
    finally:
        del model.forward
        torch._dynamo.reset()
    assert compiled == eager and one_by_one == eager
