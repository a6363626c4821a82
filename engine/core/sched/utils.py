"""The token-level stop rules, as vLLM keeps them beside its scheduler (`vllm/v1/core/sched/utils.py`)."""

from __future__ import annotations

from engine.request import Request, RequestStatus


def check_stop(request: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """The finished status that `token`, just appended to the request, gives it; None when it goes on. A stop token
    id is kept as the request's stop_reason."""
    # vLLM 0.33's order (check_stop): EOS, then stop token ids, then length. The sampler keeps EOS and stop tokens out
    # before min_tokens, so they are not checked against it here
    params = request.sampling_params
    if not params.ignore_eos and token == request.eos_token_id:
        return RequestStatus.FINISHED_STOPPED
    if token in (params.stop_token_ids or ()):
        request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
