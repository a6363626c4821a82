"""Parallel sampling (``SamplingParams.n > 1``) as vLLM V1 does it (``vllm/v1/engine/parallel_sampling.py``): one
user request fans out into n child requests with the same prompt, each sampling its own sequence; with prefix
caching on, the children share the prompt's full KV blocks (the first child's blocks are cached as they are
allocated, and the others hit them). The children are ordinary requests to the scheduler and in the events."""

from __future__ import annotations

from dataclasses import replace

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class ParentRequest:
    """Owns a parallel-sampling request's id, its children's ids and parameters, and how their outputs join."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.child_ids = [f"{i}_{request_id}" for i in range(params.n)]  # vLLM's child id format

    def child_params(self, index: int) -> SamplingParams:
        """The parameters of child `index`: n = 1, and a seed offset by the index (so seeded children differ)."""
        seed = None if self.params.seed is None else self.params.seed + index
        return replace(self.params, n=1, seed=seed)

    def make_output(self, children: list[RequestOutput]) -> RequestOutput:
        """The parent's output: every child's completion in `outputs` (in index order); the flat fields are the
        first completion's; finished once every child is."""
        first = children[0]
        finished = all(c.finished for c in children)
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=first.prompt_token_ids,
            token_ids=first.token_ids,
            text=first.text,
            finish_reason=first.finish_reason if finished else None,
            num_cached_tokens=first.num_cached_tokens,
            stop_reason=first.stop_reason,
            error=next((c.error for c in children if c.error), None),
            logprobs=first.logprobs,
            prompt_logprobs=first.prompt_logprobs,
            metrics=first.metrics,
            outputs=[replace(c.outputs[0], index=i) for i, c in enumerate(children)],
        )
