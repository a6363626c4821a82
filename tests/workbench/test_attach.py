"""`workbench attach`: the dashboard of a running server from its KV events and its /metrics alone.

- AttachedState from batches: copies, chains, what can be hit, what a removal or a reset leaves, gaps, restarts, a
  start mid-stream; /metrics parsed with vLLM's names, summed over engines, rates and the hit rate.
- Against this workbench's own server (OpenAI API + /metrics + KV events in vLLM's format): after real requests the
  attached state's hashes are exactly what the engine's prefix cache holds, copies included, and its metrics are
  /metrics'.
- Bad endpoints: malformed, or nothing listening, each an error naming its flag within a bounded time; closing
  closes the threads and sockets.
- The view without a browser, and in Chromium (marker `browser`): a live block map from a vLLM-format stream.
(A stream encoded by vLLM's own classes: tests/fidelity/test_kv_events_vllm.py.)"""

from __future__ import annotations

import http.server
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from bokeh.document import Document

from engine.config import KVEventsConfig
from engine.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
    to_external_block_hash,
)
from tests.net import free_port, stop, wait_for_http
from workbench.attach import (
    CLEARED,
    HITTABLE,
    ORPHANED,
    REMOVED,
    AttachedState,
    Attachment,
    check_metrics_url,
    parse_metrics,
)
from workbench.cli import main
from workbench.kv_events import KVEventMessage, SequenceGap

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")


def stored(hashes: list[int], parent: int | None, block_size: int = 4, first_token: int = 0) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(range(first_token, first_token + block_size * len(hashes))),
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def removed(*hashes: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium="GPU")


def message(seq: int, *events, rank: int | None = 0) -> KVEventMessage:
    return KVEventMessage(seq, "", KVEventBatch(ts=float(seq), events=list(events), data_parallel_rank=rank))


def wait_for(condition: Callable[[], bool], timeout_s: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.01)


# ---- the state, from batches --------------------------------------------------------------------------------
def test_the_state_follows_stores_removals_and_resets():
    state = AttachedState(block_size=4, num_blocks=16)
    # a prompt of 3 blocks; a second request shares its first 2 and stores 1 more; a third computed the first
    # block at the same time as the first request: two copies of it
    state.apply(message(0, stored([1, 2, 3], None), stored([1], None)))
    state.apply(message(1, stored([5], 2, first_token=8)))
    assert state.resident() == {1: 2, 2: 1, 3: 1, 5: 1} and state.num_resident_blocks == 5
    assert state.hittable() == {1, 2, 3, 5} and state.children() == {1: 1, 2: 2}
    assert [(state.nodes[h].depth, state.nodes[h].prefix_tokens) for h in (1, 2, 3, 5)] == [
        (0, 4),
        (1, 8),
        (2, 12),
        (2, 12),
    ]
    assert state.nodes[5].token_ids == (8, 9, 10, 11) and state.nodes[3].token_ids == (8, 9, 10, 11)
    prefixes = state.prefixes()
    assert [(p.leaf, p.root, p.num_blocks, p.num_tokens) for p in prefixes] == [(3, 1, 3, 12), (5, 1, 3, 12)]
    # one copy of 1 evicted: still stored; 2 evicted: 3 and 5 can no longer be hit (the lookup stops at 2)
    state.apply(message(2, removed(1), removed(2)))
    assert state.resident() == {1: 1, 3: 1, 5: 1} and state.hittable() == {1}
    assert [state.status(h, state.hittable()) for h in (1, 2, 3)] == [HITTABLE, REMOVED, ORPHANED]
    assert [p.leaf for p in state.prefixes()] == [1]
    # stored again: hit-able again, the same node (its place on the map is kept)
    state.apply(message(3, stored([2], 1)))
    assert state.hittable() == {1, 2, 3, 5} and state.nodes[2].slot == 1
    state.apply(message(4, AllBlocksCleared()))
    assert state.resident() == {} and {n.status for n in state.nodes.values()} == {CLEARED}
    assert state.event_counts == {"BlockStored": 4, "BlockRemoved": 2, "AllBlocksCleared": 1}
    assert state.ranks == {0} and state.notes == [] and state.num_batches == 5
    # what --block-size and --num-blocks say, checked against the stream
    state.apply(message(5, stored([31], None, block_size=8), stored(list(range(40, 56)), 31)))
    assert state.num_resident_blocks == 17 == sum(state.resident().values())
    assert state.notes == [
        "Batch 5 stores blocks of 8 tokens; --block-size says 4.",
        "Batch 5 leaves 17 blocks stored, more than --num-blocks (16): is --num-blocks the server's, or were "
        "removals lost?",
    ]


def test_gaps_a_late_start_and_a_restart_are_said():
    state = AttachedState()
    state.apply(message(5, stored([1], 9)))  # attached mid-stream: 9 was stored before
    assert "Attached at batch 5" in state.notes[-1]
    assert state.nodes[1].depth is None and state.hittable() == set()  # its chain's start is unknown
    state.apply(message(6, removed(7)))  # stored before attaching: counted, not drawn
    assert state.unknown_removed == 1 and 7 not in state.nodes
    state.apply(message(9, stored([2], None)))
    assert state.lost_batches == 2 and "Batches 7..8 were lost" in state.notes[-1]
    state.apply(message(10, stored([9], None)))  # the parent, stored again after the child was first seen
    assert state.hittable() == {9, 1, 2} and state.nodes[9].slot > state.nodes[1].slot
    state.apply(message(0, stored([3], None)))
    assert "started again at batch 0" in state.notes[-1] and state.resident() == {3: 1} and state.epoch == 1
    with pytest.raises(ValueError, match="--num-blocks"):
        AttachedState(num_blocks=0)


METRICS_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} %(queries)s
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} %(hits)s
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 4.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="m"} %(generated)s
"""


def test_metrics_are_read_with_vllms_names_and_counters_become_rates():
    values = parse_metrics(METRICS_TEXT % {"queries": 100.0, "hits": 25.0, "generated": 10.0})
    assert values["vllm:num_requests_running"] == 3 and values["vllm:kv_cache_usage_perc"] == 0.375  # mean of 2
    assert values["vllm:request_success_total"] == 7
    state = AttachedState()
    state.add_metrics(values, t=1.0)
    state.add_metrics(parse_metrics(METRICS_TEXT % {"queries": 300.0, "hits": 175.0, "generated": 50.0}), t=3.0)
    assert state.rate("vllm:generation_tokens_total") == 20.0
    assert state.hit_rate() == 175 / 300 and state.hit_rate(*state.samples) == 150 / 200
    assert state.metric("vllm:num_requests_waiting") is None  # not exposed: not invented
    with pytest.raises(ValueError, match="no vllm"):
        parse_metrics("# TYPE x gauge\nx 1.0\n")
    # a server's root is taken as its /metrics; a path is kept
    assert check_metrics_url("http://h:8000") == check_metrics_url("http://h:8000/") == "http://h:8000/metrics"
    assert check_metrics_url("https://h/v/metrics") == "https://h/v/metrics"


# ---- a publisher in this process ------------------------------------------------------------------------------
@pytest.fixture
def publisher() -> Iterator[ZmqEventPublisher]:
    pub = ZmqEventPublisher(
        KVEventsConfig.from_dict(
            {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}
        )
    )
    yield pub
    pub.shutdown()


def publish(pub: ZmqEventPublisher, *events) -> None:
    pub.publish(KVEventBatch(ts=time.time(), events=list(events)))


def test_attaching_catches_up_from_the_replay_follows_live_and_closes(publisher):
    publish(publisher, stored([1, 2], None))
    publish(publisher, stored([3], 2), removed(1))
    config = publisher.get_publisher_config()
    wait_for(lambda: len(publisher._buffer) == 2, what="the publisher's thread sent both")
    threads_before = set(threading.enumerate())
    with Attachment(config.endpoint, replay=config.replay_endpoint) as attachment:
        state = attachment.state
        assert state.last_seq == 1 and state.resident() == {2: 1, 3: 1} and state.notes == []  # caught up at once
        publish(publisher, stored([4], 3))  # live; the SUB socket may also have the first two: read once
        wait_for(lambda: state.last_seq == 2, what="the live batch")
        assert (
            state.resident() == {2: 1, 3: 1, 4: 1} and state.num_batches == 3 and state.event_counts["BlockStored"] == 3
        )
        # a gap the subscriber met (as one whose SUB socket dropped batches at its high-water mark): said
        attachment._sub.gaps.append(SequenceGap(7, 9, 1))
        wait_for(lambda: bool(state.notes), what="the gap said")
        assert state.notes == ["Batches 7..8 did not come live: 1 read from the replay, 1 lost."]
        threads = [t for t in threading.enumerate() if t not in threads_before]
        assert {t.name for t in threads} == {"attach-kv-events"}
        sockets = attachment._sub._sub, attachment._sub._replay
    assert not any(t.is_alive() for t in threads) and all(s is None or s.closed for s in sockets)
    # without the replay: what came before is unknown, and said
    with Attachment(config.endpoint) as late:
        for _ in range(200):  # ZeroMQ drops what is sent before the subscription arrives: send until one is read
            publish(publisher, removed(99))
            if late.state.last_seq >= 0:
                break
            time.sleep(0.02)
        wait_for(lambda: late.state.last_seq > 2, what="a live batch")
        assert "Attached at batch" in late.state.notes[0] and late.state.unknown_removed >= 1


def test_closing_the_notebook_dashboard_closes_its_threads_and_sockets(publisher):
    from workbench.views.attached import attach

    publish(publisher, stored([1, 2], None))
    config = publisher.get_publisher_config()
    wait_for(lambda: len(publisher._buffer) == 1, what="the publisher's thread sent it")
    board = attach(config.endpoint, replay=config.replay_endpoint, block_size=4)
    thread = next(t for t in threading.enumerate() if t.name == "attach-kv-events")
    assert list(board.view.cells.source.data["status"]) == [HITTABLE, HITTABLE]  # drawn as it opens
    board.close()
    assert board.attachment.closed and not thread.is_alive() and board.attachment._sub._sub.closed
    assert board._callback is None


def test_a_tail_missed_live_is_read_from_the_replay_once_the_stream_is_quiet(publisher, monkeypatch):
    """A subscription that has not reached the server yet misses what is sent, and nothing shows the gap until the
    next batch: a quiet stream is checked against the replay. Here nothing comes live at all (the attachment's topic
    filters out the publisher's), so every batch after the catch-up arrives that way, once."""
    monkeypatch.setattr(Attachment, "QUIET_REPLAY_S", 0.2)
    checks = []
    replay_tail = Attachment._replay_tail
    monkeypatch.setattr(Attachment, "_replay_tail", lambda self: checks.append(replay_tail(self)))
    config = publisher.get_publisher_config()
    with Attachment(config.endpoint, replay=config.replay_endpoint, topic="other") as attachment:
        state = attachment.state
        publish(publisher, stored([1, 2], None))
        wait_for(lambda: state.last_seq == 0, what="the batch, from the replay")
        publish(publisher, stored([3], 2))
        wait_for(lambda: state.last_seq == 1, what="the next one")
        seen = len(checks)
        wait_for(lambda: len(checks) >= seen + 2, what="two more checks")  # which find nothing new to apply
    assert state.resident() == {1: 1, 2: 1, 3: 1} and state.num_batches == 2 and state.notes == []


# ---- bad endpoints ----------------------------------------------------------------------------------------------
class _NotVLLM(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"# TYPE up gauge\nup 1.0\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def not_vllm_metrics() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotVLLM)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def _one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("workbench: error: "), err
    return lines[0]


@pytest.mark.parametrize(
    "case, flags, match",
    [
        ("malformed", ["--kv-events", "localhost:5557"], "--kv-events: expected tcp://HOST:PORT"),
        ("wildcard", ["--kv-events", "tcp://*:5557"], "--kv-events: 'tcp://\\*:5557' is where vLLM binds"),
        ("bad port", ["--kv-events", "tcp://127.0.0.1:70000"], "--kv-events: the port must be"),
        ("bad replay", ["--kv-events", "tcp://127.0.0.1:5557", "--replay", "5558"], "--replay: expected"),
        ("bad metrics", ["--kv-events", "tcp://127.0.0.1:5557", "--metrics", "127.0.0.1:8000"], "--metrics: expected"),
        ("nothing at kv events", ["--kv-events", "tcp://127.0.0.1:{free}"], "--kv-events: nothing listens at"),
    ],
)
def test_bad_endpoints_are_one_line_naming_the_flag(capsys, case, flags, match):
    flags = [f.replace("{free}", str(free_port())) for f in flags]
    start = time.monotonic()
    assert main(["attach", *flags, "--port", str(free_port())]) == 2
    assert time.monotonic() - start < 10
    line = _one_line_error(capsys.readouterr().err)
    assert re.search(match, line), line


def test_nothing_answering_the_replay_or_the_metrics_is_said_in_bounded_time(publisher, not_vllm_metrics):
    config = publisher.get_publisher_config()
    cases = [
        ({"replay": f"tcp://127.0.0.1:{free_port()}"}, ConnectionError, "--replay: nothing listens"),
        ({"metrics": f"http://127.0.0.1:{free_port()}/metrics"}, ConnectionError, "--metrics: nothing answers"),
        ({"metrics": not_vllm_metrics}, ValueError, "--metrics: .* no vllm:\\* metric"),
        # something listens but never answers a replay: bounded by the timeout
        ({"replay": config.endpoint}, ConnectionError, "--replay: .* did not answer a replay within 1.0 s"),
    ]
    for kwargs, error, match in cases:
        start = time.monotonic()
        with pytest.raises(error, match=match):
            Attachment(config.endpoint, connect_timeout_s=1.0, **kwargs)
        assert time.monotonic() - start < 8, kwargs


# ---- against this workbench's own server --------------------------------------------------------------------
@pytest.fixture(scope="module")
def served_with_events(tiny_model_path):
    from engine.async_llm import AsyncLLM
    from tests.entrypoints.conftest import serving

    llm = AsyncLLM(
        model="tiny-llama",
        num_kv_blocks=24,
        block_size=16,
        seed=0,
        kv_events_config={
            "enable_kv_cache_events": True,
            "endpoint": "tcp://127.0.0.1:0",
            "replay_endpoint": "tcp://127.0.0.1:0",
        },
    )
    yield from serving(llm)


def _engine_cache(llm) -> dict:
    """What the engine's prefix cache holds: each hash as events carry it, and the blocks that hold it."""
    with llm.lock:
        pool = llm.engine.kv_cache_manager.block_pool
        return {to_external_block_hash(h): len(blocks) for h, blocks in pool.cached_block_hash_to_block.items()}


def test_attached_to_this_workbenchs_server_the_state_is_the_engines_cache(served_with_events):
    served = served_with_events
    config = served.llm.engine.kv_event_publisher.get_publisher_config()
    client = served.client()
    shared = "A shared system prompt that fills more than one block of sixteen tokens, for the prefix cache. "
    # one request before attaching: the replay brings it
    client.completions.create(model="tiny-llama", prompt=shared + "First?", max_tokens=4, temperature=0)
    assert served.llm.wait_until_idle(30)
    with Attachment(
        config.endpoint,
        metrics=f"{served.base_url}/metrics",
        replay=config.replay_endpoint,
        block_size=16,
        num_blocks=23,
        metrics_interval_s=0.2,
    ) as attachment:
        state = attachment.state
        before = _engine_cache(served.llm)  # from the replay, or live if its last batch was still being sent
        wait_for(lambda: state.resident() == before != {}, what=f"{state.resident()} == {before}")
        # concurrent requests sharing the prefix (copies of a block computed at once), then distinct long prompts
        # that fill the 23 blocks and evict
        threads = [
            threading.Thread(
                target=client.completions.create,
                kwargs=dict(model="tiny-llama", prompt=shared + f"Q{i}?", max_tokens=8, temperature=0),
            )
            for i in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i in range(4):
            client.completions.create(model="tiny-llama", prompt=f"Distinct {i}: " + shared * 6, max_tokens=4)
        assert served.llm.wait_until_idle(30)
        expected = _engine_cache(served.llm)
        wait_for(lambda: state.resident() == expected, what=f"{state.resident()} == {expected}")
        assert state.event_counts["BlockRemoved"] > 0 and state.notes == [] and state.lost_batches == 0
        assert max(expected.values()) >= 1 and any(n.depth and n.depth > 0 for n in state.nodes.values())
        # a scrape after the engine went idle: what /metrics says
        idle = time.monotonic() - state._t0
        wait_for(lambda: state.samples[-1].t > idle + 0.01, what="a scrape after idle")
        assert state.samples[-1].values == parse_metrics(httpx.get(f"{served.base_url}/metrics").text)
        assert state.metric("vllm:num_requests_running") == 0 == state.metric("vllm:num_requests_waiting")
        assert state.metric("vllm:request_success_total") >= 7 and state.hit_rate() > 0


# ---- the view -------------------------------------------------------------------------------------------------
def test_the_view_draws_the_state_and_redraws_only_what_changed():
    from workbench.views.attached import STATUS_COLORS, AttachedView

    state = AttachedState(block_size=4)
    view = AttachedView(state, "tcp://h:5557")
    view.panel.get_root(Document())
    state.apply(message(0, stored([1, 2, 3], None), stored([4], 1, first_token=4)))
    view.refresh()
    cells = view.cells.source.data
    assert list(cells["status"]) == [HITTABLE] * 4 and list(cells["line"]) == ["black", None, None, None]
    assert list(cells["hash"])[0] == "0000000000000001" and list(cells["depth"]) == ["0", "1", "2", "1"]
    assert list(view.prefixes.value["tokens"]) == [12, 8]
    state.apply(message(1, removed(2)))
    state.add_metrics({"vllm:num_requests_running": 1.0, "vllm:generation_tokens_total": 5.0}, t=1.0)
    state.add_metrics({"vllm:num_requests_running": 0.0, "vllm:generation_tokens_total": 25.0}, t=2.0)
    view.refresh()
    assert list(cells["status"]) == [HITTABLE, REMOVED, ORPHANED, HITTABLE]
    assert list(view.nodes.source.data["color"]) == [STATUS_COLORS[s] for s in cells["status"]]
    assert list(view.series.source.data["generation_tps"])[1] == 20.0
    assert "running 0" in view.summary.object and not view.notes.visible
    state.apply(message(5, AllBlocksCleared()))
    view.refresh()
    assert (
        list(cells["status"]) == [CLEARED, REMOVED, CLEARED, CLEARED] and "Batches 2..4 were lost" in view.notes.object
    )


# ---- in Chromium --------------------------------------------------------------------------------------------
# the block map's statuses as the browser holds them ([] before the page has its document)
STATUSES = """() => {
  const doc = window.Bokeh && Bokeh.documents[0];
  const cells = doc && doc.get_model_by_name('attached_block_map');
  return cells ? Array.from(cells.data.status) : [];
}"""


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing: `apt-get install -y chromium` (CI has it)")
def test_the_attached_dashboard_draws_a_live_block_map_in_chromium(publisher):
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    from tests.workbench.test_browser import CHROMIUM_ARGS

    publish(publisher, stored([1, 2, 3], None), stored([4], 2))
    config = publisher.get_publisher_config()
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "workbench.cli", "attach", "--kv-events", config.endpoint]
        + ["--replay", config.replay_endpoint, "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_for_http(f"{url}liveness", server, timeout=120, name="workbench attach")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.goto(url)
                page.wait_for_function(f"() => ({STATUSES})().length === 4", timeout=30_000)
                assert page.evaluate(STATUSES) == [HITTABLE] * 4
                publish(publisher, removed(2))  # live: 3 can no longer be hit
                page.wait_for_function(f"() => ({STATUSES})()[1] === '{REMOVED}'", timeout=15_000)
                assert page.evaluate(STATUSES) == [HITTABLE, REMOVED, ORPHANED, ORPHANED]
                page.get_by_text("What KV events and /metrics cannot tell").first.wait_for(timeout=5_000)
            finally:
                browser.close()
    finally:
        stop(server)
