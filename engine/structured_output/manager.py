"""The StructuredOutputManager: compiles grammars off the step loop and keeps each guided request's matcher."""

from __future__ import annotations

import time
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from engine.events import EventLog, GrammarCompiled, GrammarStep
from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.structured_output.backend_xgrammar import Grammar, XgrammarBackend


def xgrammar_backend() -> ModuleType:
    """The xgrammar backend, imported at the first guided request: xgrammar and jsonschema are needed for guided
    decoding only, so an install without them (the GPU image has neither) runs everything else."""
    from engine.structured_output import backend_xgrammar

    return backend_xgrammar


class ScriptedGrammar:
    """Stands for a compiled grammar where whoever drives the engine says when each grammar is ready
    (`StructuredOutputManager.script_grammars`): it allows every token and never terminates, as the stand-in
    `workbench fidelity` gives vLLM's scheduler does."""

    def accept_token(self, token: int) -> bool:
        return True

    def rollback(self, num_tokens: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> int:
        bitmask[row] = -1  # every bit set: every token allowed
        return bitmask.shape[1] * 32

    def jump_forward_string(self) -> str:
        return ""


@dataclass
class StructuredOutputRequest:
    """A guided request's grammar: the compile in flight, then the matcher."""

    key: tuple[str, str]
    future: Future | None  # the compile in flight; dropped once grammar or error is set
    cache_hit: bool = False
    grammar: Grammar | ScriptedGrammar | None = None
    error: str | None = None
    submitted: float = field(default_factory=time.perf_counter)


class StructuredOutputManager:
    """Owns the xgrammar backend (built on the first guided request), a compile thread pool, the compile
    cache keyed by grammar, and the per-step bitmask. Requests wait in
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR while they compile."""

    def __init__(self, tokenizer, vocab_size: int, events: EventLog, max_workers: int = 1) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.events = events
        self._backend: XgrammarBackend | None = None
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._cache: dict[tuple[str, str], Future] = {}
        self.requests: dict[str, StructuredOutputRequest] = {}
        self._allowed: dict[str, int] = {}  # this step's allowed-token count per guided request
        self.scripted = False  # script_grammars: nothing compiles, grammar_ready says when each grammar is there

    def script_grammars(self) -> None:
        """From now on no grammar compiles: a guided request waits until `grammar_ready` is called for it, and its
        grammar (a ScriptedGrammar) allows every token. For a model-free engine driven by a script
        (`workbench fidelity`'s guided group), which decides at which step each grammar is ready."""
        self.scripted = True

    def grammar_ready(self, request_id: str, error: str | None = None) -> None:
        """A scripted grammar is ready (or failed to compile with `error`): the next schedule() sees it."""
        future = self.requests[request_id].future
        assert self.scripted and future is not None, "only a scripted grammar still waiting is made ready"
        if error is None:
            future.set_result(ScriptedGrammar())
        else:
            future.set_exception(ValueError(error))

    @property
    def backend(self) -> XgrammarBackend:
        if self._backend is None:
            self._backend = xgrammar_backend().XgrammarBackend(self.tokenizer, self.vocab_size)
        return self._backend

    def add_request(self, request: Request) -> None:
        """Start compiling the request's grammar (or reuse the cached one); the request waits for it."""
        key = xgrammar_backend().grammar_key(request.sampling_params.structured_outputs)
        if self.scripted:  # not shared: each request's grammar is ready when its script says
            self.requests[request.request_id] = StructuredOutputRequest(key, Future())
            request.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            return
        cached = key in self._cache
        if not cached:
            backend = self.backend
            self._cache[key] = self._executor.submit(backend.compile, key)
        self.requests[request.request_id] = StructuredOutputRequest(key, self._cache[key], cached)
        request.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR

    def check_ready(self, request: Request) -> bool:
        """True once the grammar is compiled (the request may be scheduled); a failed compile sets `error`."""
        so = self.requests[request.request_id]
        if so.grammar is not None or so.error is not None:
            return so.grammar is not None
        future = so.future
        assert future is not None, "released only once grammar or error is set"
        if not future.done():
            return False
        try:
            compiled = future.result()
            so.grammar = compiled if isinstance(compiled, ScriptedGrammar) else xgrammar_backend().Grammar(compiled)
        except Exception as exc:  # the compiler's message is the user's answer
            so.error = f"grammar: {type(exc).__name__}: {exc}"
            self._cache.pop(so.key, None)
            return False
        finally:
            so.future = None
        self.events.emit(
            GrammarCompiled,
            request_id=request.request_id,
            ms=(time.perf_counter() - so.submitted) * 1e3,
            cache_hit=so.cache_hit,
        )
        request.status = RequestStatus.WAITING
        return True

    def wait_for_any(self, request_ids: list[str], timeout: float) -> None:
        """Block until one of these requests' grammars is compiled (or `timeout` seconds pass)."""
        self._wait(request_ids, timeout, FIRST_COMPLETED)

    def wait_for_all(self, request_ids: list[str], timeout: float) -> None:
        """Block until all of these requests' grammars are compiled (or `timeout` seconds pass): a benchmark that
        wants them scheduled together (the compiles run in threads, and a request waits for its own)."""
        self._wait(request_ids, timeout, ALL_COMPLETED)

    def _wait(self, request_ids: list[str], timeout: float, return_when: str) -> None:
        futures = [so.future for rid in request_ids if (so := self.requests.get(rid)) and so.future is not None]
        if futures and not self.scripted:  # a scripted grammar is made ready between steps, never during one
            wait(futures, timeout=timeout, return_when=return_when)

    def error(self, request_id: str) -> str | None:
        so = self.requests.get(request_id)
        return so.error if so else None

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def is_guided(self, request_id: str) -> bool:
        return request_id in self.requests

    # ---- per step -----------------------------------------------------------------------------
    def grammar_bitmask(self, sampling: list[tuple[str, list[int]]]) -> tuple[torch.Tensor | None, list[int]]:
        """Fill one bitmask row per sampled position, in batch order: for each sampling request, its
        (request id, drafts); a request with k drafts samples at k+1 positions. The matcher walks through
        the drafts to fill their rows, then rolls back. Returns the bitmask (rows aligned with the logits
        rows) and the guided rows."""
        self._allowed = {}
        if not any(rid in self.requests for rid, _ in sampling):
            return None, []
        if self.scripted:  # every token is allowed: no mask
            self._allowed = {rid: self.vocab_size for rid, _ in sampling if rid in self.requests}
            return None, []
        bitmask = self.backend.allocate_bitmask(sum(1 + len(d) for _, d in sampling))
        rows, row = [], 0
        for rid, drafts in sampling:
            if rid in self.requests:
                grammar = self._matcher(rid)
                for j in range(len(drafts) + 1):
                    allowed = grammar.fill_bitmask(bitmask, row + j)
                    self._allowed.setdefault(rid, allowed)
                    if j < len(drafts):
                        grammar.accept_token(drafts[j])  # validated when proposed
                    rows.append(row + j)
                grammar.rollback(len(drafts))
            row += 1 + len(drafts)
        return bitmask, rows

    def _matcher(self, request_id: str) -> Grammar | ScriptedGrammar:
        grammar = self.requests[request_id].grammar
        if grammar is None:  # the scheduler runs a guided request only once check_ready said so
            raise RuntimeError(f"grammar: request {request_id} ran before its grammar compiled")
        return grammar

    def validate_tokens(self, request: Request, tokens: list[int]) -> int:
        """How many of these drafts, in order, the grammar accepts (its state is left unchanged)."""
        grammar = self._matcher(request.request_id)
        count = 0
        for token in tokens:
            if grammar.is_terminated() or not grammar.accept_token(token):
                break
            count += 1
        grammar.rollback(count)
        return count

    def accept_tokens(self, request: Request, tokens: list[int]) -> bool:
        """Advance the matcher; returns True when the grammar has terminated (the request is complete)."""
        grammar = self._matcher(request.request_id)
        for token in tokens:
            if not grammar.accept_token(token):
                raise RuntimeError(f"grammar: token {token} rejected for request {request.request_id}")
        terminated = grammar.is_terminated()
        self.events.emit(
            GrammarStep,
            request_id=request.request_id,
            num_allowed_tokens=self._allowed.get(request.request_id, 0),
            sampled_token=tokens[-1],
            terminated=terminated,
            jump_forward=None if terminated else (grammar.jump_forward_string() or None),
        )
        return terminated
