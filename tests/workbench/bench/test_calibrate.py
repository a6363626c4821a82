"""`bench calibrate`'s pieces: a real step's batch read back from its events, and the fit recovering known factors."""

from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.executor.sim.cost_model import CostModel, ScheduledShape
from engine.executor.sim.hardware import Efficiency, get_hardware
from engine.executor.sim.model_spec import load_model_spec
from workbench.bench.calibrate import FILL_GRID, GRID, fit_efficiency, step_shapes


def test_step_shapes_read_back_what_the_executor_priced() -> None:
    """Chunked prefills, prefix hits and decodes on the simulated engine: the batch rebuilt from each record's
    events prices to exactly the record's time."""
    llm = LLM(
        model="llama-3.1-8b", executor="simulated", hardware="h100-sxm", num_kv_blocks=200, max_num_batched_tokens=96
    )
    eng = llm.engine
    shared = list(range(300, 364))
    for i, n in enumerate((100, 40, 150)):
        eng.add_request(shared + [1000 + i] * n, SamplingParams(max_tokens=5 + i, ignore_eos=True))
    records = eng.run()
    assert {"chunk", "decode"} <= {p for r in records for p in r.phases.values()}
    assert any(e.num_hit_tokens for r in records for e in r.of_kind("prefix.lookup"))
    model = CostModel(load_model_spec("llama-3.1-8b"), get_hardware("h100-sxm"), 1, "bfloat16")
    assert step_shapes(records[0]) == [ScheduledShape(0, 96, 0)]  # the first chunk of 164 tokens samples nothing
    for record in records:
        assert model.step_cost(step_shapes(record)).total_s * 1e3 == pytest.approx(record.timing["total"])


def test_fit_recovers_known_factors() -> None:
    """Step times made by a cost model with factors on the grid (GEMMs above 8 rows filling 16 more) and known fixed
    costs: the fit finds them."""
    spec = load_model_spec("llama-3.1-8b")
    truth = Efficiency(
        compute=float(GRID[6]),
        memory=float(GRID[4]),
        attention=float(GRID[2]),
        gemm_fill_rows=FILL_GRID[3],
        gemv_max_rows=8,
        step_overhead_s=2e-3,
        request_overhead_s=1e-4,
        token_overhead_s=2e-6,
    )
    model = CostModel(spec, get_hardware("a100-80gb"), 1, "bfloat16", truth)
    rng = np.random.default_rng(0)
    batches = [
        [
            ScheduledShape(int(rng.integers(0, 2000)), int(rng.choice([1, 1, 1, rng.integers(2, 600)])), 1)
            for _ in range(int(rng.integers(1, 24)))
        ]
        for _ in range(60)
    ]
    measured = [model.step_cost(b).total_s for b in batches]
    fitted, error = fit_efficiency(CostModel(spec, get_hardware("a100-80gb"), 1, "bfloat16"), batches, measured, 8)
    assert error < 1e-6
    assert (fitted.compute, fitted.memory, fitted.attention) == pytest.approx((GRID[6], GRID[4], GRID[2]))
    assert (fitted.gemm_fill_rows, fitted.gemv_max_rows) == (FILL_GRID[3], 8)
    assert (fitted.step_overhead_s, fitted.request_overhead_s, fitted.token_overhead_s) == pytest.approx(
        (2e-3, 1e-4, 2e-6), rel=1e-6
    )
