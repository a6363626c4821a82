"""MultiProcExecutor: tensor-parallel workers on torch.distributed (vLLM's `vllm/v1/executor/multiproc_executor.py`).

The engine process keeps the one scheduler and KV cache manager. `tensor_parallel_size` worker processes (started
with `spawn`: fork would copy torch's threads and locks) each join a gloo group (NCCL on CUDA), build their shard
of the model (engine/model/llama.py reads the group: their heads, columns, rows and vocabulary), their share of
the KV cache (their KV heads, the same block ids on every rank) and a ModelRunner. Each step the executor sends
every worker the step's work and every worker runs the same forward; the collectives inside it (an all-reduce
after o_proj and down_proj, one for the embedding, an all-gather of the logits) keep them in lock step.

The channel: one `multiprocessing` Pipe per worker, carrying a small pickled message per step. vLLM writes
the SchedulerOutput once into a shared-memory ring buffer (`shm_broadcast.MessageQueue`) that every worker reads,
which matters when a GPU step takes a few milliseconds and eight readers would each pay a socket copy. Here a step
is milliseconds of CPU compute and the message a few hundred bytes (only what changed: vLLM's NewRequestData for
a request the workers have not seen, then per step its new tokens and new block ids), so a pipe's copy costs
microseconds, and a pipe gives two things for free: a worker blocked on `recv` sees EOF when the engine process
dies (it exits at once), and the engine sees EOF when a worker dies. Every worker answers every step (rank 0
with the sampled tokens, every rank with its forward time and its collectives), so a step also checks that every
rank is alive, and the per-rank numbers become one `parallel.step` event.

Processes are always reaped: `shutdown` (LLMEngine.close, its context manager), a finalizer at garbage
collection and at interpreter exit, and in the worker both the pipe's EOF and a watchdog on the parent's pid.
A worker that dies or hangs makes `execute_model` raise within `WORKBENCH_DIST_TIMEOUT_S` seconds (default 60;
also every collective's timeout), naming the rank; the other workers are then stopped.

Rendezvous binds nothing beyond this machine: a FileStore in a private temporary folder (no listening port: the
TCP store would listen on every interface) and gloo's pairs on the loopback interface (GLOO_SOCKET_IFNAME=lo).
Over several nodes (`nnodes` > 1, engine/distributed/nodes.py) this node spawns only its own ranks, rank 0 hosts a
TCP store on the master port, and the other nodes' ranks (`python -m engine.distributed.launch`) connect on the
master port + 1 instead of a pipe; set GLOO_SOCKET_IFNAME to the interface between the machines.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any, NoReturn

import torch

from engine.clock import Clock
from engine.config import EngineConfig
from engine.core.sched.output import ScheduledRequest, SchedulerOutput
from engine.distributed.nodes import accept_ranks, authkey, master_address, node_ranks
from engine.events import EventLog, ParallelStep
from engine.executor.abstract import Executor
from engine.model.llama import ModelShape
from engine.model.loader import resolve_model
from engine.model.runner import ModelRunnerOutput
from engine.request import Request
from engine.sampling_params import SamplingParams

START_TIMEOUT_S = 300.0  # spawning, importing torch and loading a shard: minutes on a loaded 2-core machine


def dist_timeout_s() -> float:
    """Seconds a step may wait for a worker, and a collective for its peers."""
    return float(os.environ.get("WORKBENCH_DIST_TIMEOUT_S", "60"))


class WorkerError(RuntimeError):
    """A tensor-parallel worker died, hung or raised; the message names the rank."""


# ---- what crosses the pipe ------------------------------------------------------------------------------------
@dataclass
class NewRequestData:
    """A request the workers have not seen: what its shadow Request needs (vLLM's NewRequestData)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    bad_words_token_ids: list[list[int]]


@dataclass
class ScheduledData:
    """One request's share of a step, with the tokens the workers lack (its token list only ever grows)."""

    request_id: str
    new_token_ids: list[int]
    num_new_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    samples: bool
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class StepMessage:
    """One step, as every worker receives it."""

    new_requests: list[NewRequestData]
    scheduled: list[ScheduledData]
    preempted_req_ids: list[str]
    finished_req_ids: set[str]
    grammar_bitmask: torch.Tensor | None = None
    guided_rows: list[int] | None = None
    num_spec_tokens_to_schedule: int | None = None


@dataclass
class RankReport:
    """What one rank did in a step: its forward and sampling time and its collectives by kind."""

    rank: int
    forward_ms: float
    sample_ms: float
    collectives: dict[str, dict[str, float]]


# ---- the worker process -------------------------------------------------------------------------------------
def _watch_parent(parent_pid: int) -> None:
    """Exit when the engine process is gone, even while blocked inside a collective (the pipe's EOF covers the
    case where the worker waits on `recv`)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


class _Worker:
    """One rank: owns its process group, its model shard, its KV cache and runner, and shadow Requests."""

    def __init__(
        self, rank: int, size: int, init_method: str, config: EngineConfig, model_path: Path, threads: int
    ) -> None:
        import torch.distributed as dist

        from engine.distributed.parallel_state import init_tp_group
        from engine.model.runner import ModelRunner

        torch.set_num_threads(threads)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs on loopback only
        cuda = config.device is not None and config.device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=dist_timeout_s()),
        )
        self.tp = init_tp_group(rank, size, dist.group.WORLD)
        self.rank = rank
        self.events = EventLog()  # the runner's own events stay here (moe routing is refused under TP)
        self.runner = ModelRunner(config, model_path, self.events)
        self.requests: dict[str, Request] = {}

    def ready_info(self) -> dict[str, Any]:
        r = self.runner
        return {
            "num_blocks": r.num_blocks,
            "bytes_per_block": r.bytes_per_block,
            "vocab_size": r.vocab_size,
            "eos_token_id": getattr(r.hf_config, "eos_token_id", None),
            "num_kv_heads": r.num_kv_heads,
        }

    def step(self, msg: StepMessage) -> tuple[ModelRunnerOutput | None, RankReport]:
        for rid in msg.finished_req_ids:  # first: a finished id may come back as a new request in this step
            self.requests.pop(rid, None)
        for new in msg.new_requests:
            request = Request(new.request_id, new.prompt_token_ids, new.sampling_params, new.eos_token_id)
            request.bad_words_token_ids = new.bad_words_token_ids
            self.requests[new.request_id] = request
        scheduled = []
        for s in msg.scheduled:
            request = self.requests[s.request_id]
            request.all_token_ids.extend(s.new_token_ids)
            request.output_token_ids = request.all_token_ids[request.num_prompt_tokens :]
            scheduled.append(
                ScheduledRequest(
                    request, s.num_new_tokens, s.num_computed_tokens, s.block_ids, s.samples, s.spec_token_ids
                )
            )
        out = SchedulerOutput(
            scheduled,
            msg.preempted_req_ids,
            msg.finished_req_ids,
            num_spec_tokens_to_schedule=msg.num_spec_tokens_to_schedule,
        )
        self.tp.take_stats()
        self.events.begin(0)
        result = self.runner.execute_model(out, msg.grammar_bitmask, msg.guided_rows)
        for rid, entries in result.prompt_logprobs.items():  # the runner reads how many it has reported
            kept = self.requests[rid].prompt_logprobs
            assert kept is not None, "the runner computes prompt logprobs only for requests that asked"
            kept.extend(entries)
        report = RankReport(self.rank, result.forward_ms, result.sample_ms, self.tp.take_stats())
        # every rank sampled the same tokens from the same gathered logits; rank 0's are the ones returned
        return (result if self.rank == 0 else None), report


def _worker_main(
    rank: int, size: int, init_method: str, config: EngineConfig, model_path: Path, conn, parent_pid: int, threads: int
) -> None:
    """The worker's life: start, report ready (or the error), then one reply per step until stop or EOF. Any
    error is sent back naming the rank, and the process exits: its group cannot be trusted after a failed
    collective."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()
    try:
        worker = _Worker(rank, size, init_method, config, model_path, threads)
        conn.send(("ready", rank, worker.ready_info()))
    except BaseException:
        _send_quietly(conn, ("error", rank, traceback.format_exc()))
        return
    try:
        with torch.inference_mode():
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    break  # the engine is gone
                if msg[0] == "stop":
                    break
                conn.send(("ok", rank, *worker.step(msg[1])))
    except BaseException:
        _send_quietly(conn, ("error", rank, traceback.format_exc()))
        os._exit(1)  # skip destroying a group whose peer may be dead (it could block)
    # Out without tearing the group down, as on an error: the ranks stop in any order, and gloo's threads, destroyed
    # while a peer was already closing its side, aborted a rank now and then ("terminate called without an active
    # exception", exit code -6, in CI's test_two_nodes_on_loopback_give_one_process_tokens). Nothing is left to flush
    # but stdio; the sockets close with the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _send_quietly(conn, msg: tuple) -> None:
    try:
        conn.send(msg)
    except (OSError, EOFError):
        pass


# ---- the engine side ------------------------------------------------------------------------------------------
def _reap(procs: list, conns: list, store_dir: str) -> None:
    """Stop the workers (politely, then by force), close the pipes and remove the rendezvous folder. Safe to
    call twice; also the finalizer at garbage collection and at interpreter exit."""
    for conn in conns:
        _send_quietly(conn, ("stop",))
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)
    for conn in conns:
        conn.close()
    shutil.rmtree(store_dir, ignore_errors=True)


class MultiProcExecutor(Executor):
    """Owns the worker processes (one per tensor-parallel rank), a pipe to each, the rendezvous folder, and what
    the workers know of each request (which ids they hold and how many of its tokens)."""

    def __init__(self, config: EngineConfig, events: EventLog, clock: Clock) -> None:
        super().__init__(config, events, clock)
        from transformers import AutoConfig

        from engine.distributed.parallel_state import check_tp_divides

        self.model_path = resolve_model(config.model, config.revision)
        hf_config = AutoConfig.from_pretrained(self.model_path)
        self.size = config.tensor_parallel_size
        check_tp_divides(hf_config.num_attention_heads, hf_config.num_key_value_heads, self.size)
        if hf_config.model_type == "qwen3_moe" and self.size > 1:
            raise ValueError("tensor_parallel_size: mixture-of-experts models (qwen3_moe) are not split yet")
        if config.device is not None and config.device.startswith("cuda") and torch.cuda.device_count() < self.size:
            raise ValueError(f"tensor_parallel_size: {self.size} needs as many GPUs, found {torch.cuda.device_count()}")
        self.model_shape = ModelShape.from_config(hf_config)  # the whole model's (each rank holds its heads)
        self._known: dict[str, int] = {}  # request id -> how many of its tokens the workers hold
        self._failed: str | None = None
        self._start_workers()

    def _start_workers(self) -> None:
        ctx = mp.get_context("spawn")
        store_dir = tempfile.mkdtemp(prefix="workbench-tp-")
        nnodes, (addr, port) = self.config.nnodes, master_address(self.config.master_addr, self.config.master_port)
        # one node: a FileStore in a private folder, no port; several: rank 0 hosts a TCP store on the master port
        init_method = f"file://{os.path.join(store_dir, 'store')}" if nnodes == 1 else f"tcp://{addr}:{port}"
        listener = None if nnodes == 1 else Listener((addr, port + 1), authkey=authkey())
        local = node_ranks(self.size, nnodes, 0)
        # the CPU's threads shared between this node's ranks: oversubscribed threads spin against each other
        self.threads_per_rank = threads = max(1, (os.cpu_count() or 1) // len(local))
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[mp.connection.Connection] = []
        self._reaper = weakref.finalize(self, _reap, self._procs, self._conns, store_dir)
        for rank in local:
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                name=f"tp-worker-{rank}",
                daemon=True,
                args=(rank, self.size, init_method, self.config, self.model_path, child_end, os.getpid(), threads),
            )
            proc.start()
            child_end.close()  # the parent's copy of the child's end: without closing it, a dead child gives no EOF
            self._procs.append(proc)
            self._conns.append(parent_end)
        try:
            if listener is not None:  # the other nodes' ranks, after this node's: rank order
                self._conns += accept_ranks(listener, range(len(local), self.size), self.config, START_TIMEOUT_S)
            infos = self._gather("ready", START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        blocks = {info["num_blocks"] for info in infos}
        if len(blocks) != 1:  # every rank holds the same block ids: the smallest cache would bound them all
            self.shutdown()
            raise RuntimeError(f"tensor-parallel ranks sized different KV caches: {sorted(blocks)} blocks")
        info = infos[0]
        self.num_blocks = info["num_blocks"]
        self.vocab_size = info["vocab_size"]
        self.eos_token_id = info["eos_token_id"]
        # one block's K and V over every rank (KV heads split, or replicated where fewer than ranks)
        self.bytes_per_block = sum(i["bytes_per_block"] for i in infos)
        self.kv_heads_per_rank = info["num_kv_heads"]

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, rank order."""
        return [p.pid for p in self._procs if p.pid is not None]  # every started process has one

    def determine_num_available_blocks(self) -> int:
        """Each rank sized its cache from `kv_cache_memory` (per rank, as vLLM's per-GPU memory); all agree."""
        return self.num_blocks

    def validate_request(self, params: SamplingParams) -> None:
        """Everything a request may ask is run by every rank's runner as in one process."""

    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        grammar_bitmask: torch.Tensor | None = None,
        guided_rows: list[int] | None = None,
    ) -> ModelRunnerOutput:
        """Send the step to every rank, wait for every rank's reply, record what each did; rank 0's tokens."""
        if self._failed is not None:
            raise WorkerError(f"the tensor-parallel workers are stopped: {self._failed}")
        msg = self._message(scheduler_output, grammar_bitmask, guided_rows)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(("step", msg))
            except (OSError, EOFError):
                self._fail(f"rank {rank} is gone (exit code {self._procs[rank].exitcode})")
        replies = self._gather("ok", dist_timeout_s())
        self.events.emit(
            ParallelStep,
            tensor_parallel_size=self.size,
            ranks=tuple(
                {
                    "rank": r.rank,
                    "forward_ms": round(r.forward_ms, 4),
                    "sample_ms": round(r.sample_ms, 4),
                    "collectives": r.collectives,
                }
                for _, r in replies
            ),
        )
        return replies[0][0]

    def _message(
        self, out: SchedulerOutput, bitmask: torch.Tensor | None, guided_rows: list[int] | None
    ) -> StepMessage:
        """The step as a diff of what the workers hold: new requests whole, then only new tokens and blocks."""
        new, scheduled = [], []
        for rid in out.finished_req_ids:  # first: a finished id may come back as a new request in this step
            self._known.pop(rid, None)
        for s in out.scheduled:
            request = s.request
            known = self._known.get(s.request_id)
            if known is None:
                new.append(
                    NewRequestData(
                        s.request_id,
                        request.prompt_token_ids,
                        request.sampling_params,
                        request.eos_token_id,
                        request.bad_words_token_ids,
                    )
                )
                known = request.num_prompt_tokens
            self._known[s.request_id] = request.num_tokens
            scheduled.append(
                ScheduledData(
                    s.request_id,
                    request.all_token_ids[known:],
                    s.num_new_tokens,
                    s.num_computed_tokens,
                    s.block_ids,
                    s.samples,
                    s.spec_token_ids,
                )
            )
        return StepMessage(
            new,
            scheduled,
            list(out.preempted_req_ids),
            set(out.finished_req_ids),
            bitmask,
            guided_rows,
            out.num_spec_tokens_to_schedule,
        )

    def _gather(self, expected: str, timeout_s: float) -> list:
        """One reply per rank, in rank order, within `timeout_s`. A death, an error or the timeout stops every
        worker and raises WorkerError naming the rank."""
        replies: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(
                    f"rank(s) {sorted(pending.values())} did not answer within {timeout_s:.0f} s "
                    "(WORKBENCH_DIST_TIMEOUT_S)"
                )
            ready = mp.connection.wait([*pending, *sentinels], timeout=left)
            for obj in ready:
                if obj in pending:
                    rank = pending[obj]
                    try:
                        reply = obj.recv()
                    except (EOFError, OSError):
                        self._fail(f"rank {rank} died (exit code {self._exitcode(rank)})")
                    if reply[0] == "error":
                        self._fail(f"rank {reply[1]} failed:\n{reply[2]}")
                    replies[rank] = reply[2:] if expected == "ok" else reply[2]
                    del pending[obj]
            for obj in ready:
                # a dead process whose answer is not pending is fine; one we still wait for is a failure (its
                # pipe may hold a last error message: read it first)
                dead = sentinels.get(obj) if isinstance(obj, int) else None  # a sentinel is an int
                if dead is not None and self._conns[dead] in pending:
                    conn = self._conns[dead]
                    if conn.poll(0):
                        continue  # its message is read on the next pass
                    self._fail(f"rank {dead} died (exit code {self._exitcode(dead)})")
        return [replies[rank] for rank in range(self.size)]

    def _exitcode(self, rank: int) -> int | None:
        if rank >= len(self._procs):
            return None  # a rank on another node: its process is not ours to see
        self._procs[rank].join(timeout=1.0)
        return self._procs[rank].exitcode

    def _fail(self, why: str) -> NoReturn:
        # a rank that died first makes its peers' collectives fail: name the dead ones, whoever reported
        time.sleep(0.2)
        dead = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self._procs) if p.exitcode not in (None, 0)]
        if dead:
            why = f"{why}\n(processes dead: {', '.join(dead)})"
        self._failed = why
        self.shutdown()
        raise WorkerError(f"tensor-parallel executor: {why}")

    def shutdown(self) -> None:
        """Stop and reap every worker (idempotent)."""
        self._reaper()
