"""A KV block's life (engine/block_life.py, LLMEngine.block_life): allocated to, filled, cached, hit by whom,
freed, evicted for whom, then allocated again; and vLLM's three KV residency metrics, for every block."""

from engine import LLMEngine, SamplingParams
from engine.block_life import BlockLife
from engine.reasons import Eviction

P = list(range(100, 108))  # two full blocks of 4, shared by three requests


def test_a_shared_prefix_block_hit_twice_then_evicted():
    engine = LLMEngine(
        executor="scripted",
        token_script=lambda request: 7,
        num_kv_blocks=8,
        block_size=4,
        enable_prefix_caching=True,
    )
    records = []
    for rid, prompt in (("r0", P + [40]), ("r1", P + [50]), ("r2", P + [60]), ("r3", list(range(500, 527)))):
        engine.add_request(prompt, SamplingParams(max_tokens=1), request_id=rid)
        records += engine.run()  # one step each: r3's 27 tokens take all seven blocks, evicting r0's prefix
    start = [None] + [r.start_ns for r in records]  # by step
    first, second = engine.block_life(1)
    assert first == BlockLife(
        block_id=1,
        allocated_step=1,
        allocated_to="r0",
        allocated_ns=start[1],
        filled_step=1,
        cached_step=1,
        block_hash=first.block_hash,
        hits=[(2, "r1"), (3, "r2")],
        freed=[(1, "r0"), (2, "r1"), (3, "r2")],
        evicted_step=4,
        eviction=Eviction(cause="reused", for_request="r3", last_used_step=3, last_used_by="r2"),
        ended_step=4,
        ended_for="r3",
        lifetime_s=(start[4] - start[1]) / 1e9,
        idle_s=(start[4] - start[3]) / 1e9,
        reuse_gaps_s=((start[3] - start[2]) / 1e9,),
        access_ns=first.access_ns,
    )
    assert first.block_hash is not None and list(first.access_ns) == [start[2], start[3]]
    assert (second.allocated_step, second.allocated_to, second.ended_step) == (4, "r3", None)
    # block 3 held each request's last, partial block: four short lives, never cached, never hit
    assert [(life.allocated_to, life.cached_step, life.ended_for) for life in engine.block_life(3)] == [
        ("r0", None, "r1"),
        ("r1", None, "r2"),
        ("r2", None, "r3"),
        ("r3", 4, None),
    ]
    metrics = engine.explainer.kv_block_metrics
    ended = [life for b in range(1, 8) for life in engine.block_life(b) if life.ended_step is not None]
    assert sorted(metrics.lifetime_s) == sorted(life.lifetime_s for life in ended)
    assert sorted(metrics.idle_before_evict_s) == sorted(life.idle_s for life in ended)
    assert sorted(metrics.reuse_gap_s) == sorted(gap for life in ended for gap in life.reuse_gaps_s)
    assert len(ended) == 5 and len(metrics.reuse_gap_s) == 2  # blocks 1 and 2: one gap each


def test_a_block_is_filled_when_its_last_slot_is_computed():
    engine = LLMEngine(executor="scripted", token_script=lambda request: 7, num_kv_blocks=8, block_size=4)
    engine.add_request(list(range(100, 106)), SamplingParams(max_tokens=4, ignore_eos=True), request_id="r")
    engine.run()
    (first,), (second,) = engine.block_life(1), engine.block_life(2)
    assert (first.filled_step, second.allocated_step, second.filled_step) == (1, 1, 3)  # positions 6, 7: steps 2, 3
    assert (first.cached_step, second.cached_step, second.freed) == (1, 3, [(4, "r")])
