"""LLM: offline batch inference over an LLMEngine (vLLM's `vllm/entrypoints/llm.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.entrypoints.core_client import batch_prompts
from engine.events import RequestFinished
from engine.limits import check_engine_limits
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.entrypoints.dp_client import DPLBClient


class LLM:
    """Offline batch inference over an LLMEngine: generate() and chat() run requests to completion.

    With data_parallel_size > 1, `engine` is a DPLBClient (engine/entrypoints/dp_client.py): that many engine
    processes behind a router; `engine.records()` and `engine.routing_events()` show what each did."""

    def __init__(self, model: str = "smollm2-135m", **kwargs: Any) -> None:
        config = EngineConfig.from_kwargs(model=model, **kwargs)
        if config.data_parallel_size > 1:
            from engine.entrypoints.dp_client import DPLBClient

            self.engine: LLMEngine | DPLBClient = DPLBClient(config).start()
        else:
            self.engine = LLMEngine(config)

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism) or replicas (data parallelism); also on leaving
        a `with LLM(...)` block."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. `params`: one for all, or one per prompt.
        A request past the engine's limits (engine/limits.py: n, logprobs) refuses the batch before any is queued."""
        batch = batch_prompts(prompts, params)
        for _, p in batch:
            check_engine_limits(p, self.engine.config)
        if not isinstance(self.engine, LLMEngine):  # the data-parallel front end routes and waits itself
            return self.engine.generate(prompts, params)
        ids = []
        try:
            for prompt, p in batch:
                ids.append(self.engine.add_request(prompt, p))
        except (ValueError, TypeError):
            for rid in ids:  # a bad prompt refuses the whole batch before any work is done
                self.engine.abort(rid)
                self.engine.pop_output(rid)
            raise
        return self._run(self.engine, ids, use_tqdm)

    @staticmethod
    def _run(engine: LLMEngine, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        # a request with n > 1 is done when all its children are
        unfinished = {rid: set(engine.child_ids(rid)) for rid in ids}
        # by the finished ids alone: a step looks at the requests that ended in it, not at all of a big batch
        parent = {child: rid for rid, children in unfinished.items() for child in children}
        # disable=None: a bar on an interactive terminal (and in a notebook, where tqdm.auto draws a widget), none
        # when stderr is piped or redirected; use_tqdm=False turns it off everywhere.
        with tqdm(total=len(ids), desc="generate", disable=None if use_tqdm else True, unit="req") as bar:
            while unfinished:
                record = engine.step()
                for child in (e.request_id for e in record.events if isinstance(e, RequestFinished)):
                    rid = parent.get(child)
                    if rid is not None and rid in unfinished:
                        unfinished[rid].discard(child)
                        if not unfinished[rid]:
                            del unfinished[rid]
                            bar.update(1)
        return [engine.pop_output(rid) for rid in ids]

    def chat(
        self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            list(self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
            for c in conversations
        ]
        return self.generate(prompts, params, use_tqdm)
