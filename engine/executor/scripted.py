"""TokenScript: the tokens a model-free engine samples, chosen by whoever drives it.

`executor="scripted"` (or `executor="simulated"` given a `token_script`) runs the engine's real scheduler, KV cache
and prefix cache with no model: every request that samples in a step takes its next token from the script. A script
is `{request_id: [token ids]}` (output token i of a request is its list's item i; past the end of its list, or with
no list, the model's EOS) or a callable `(request) -> token id` (it reads `request.request_id` and
`request.output_token_ids`). EOS and stop tokens in a script end the request as they would from a model, which is
how `workbench fidelity` drives this scheduler side by side with vLLM's own on the same tokens.

A `ScriptedModel` as the token_script scripts a proposer too (with `speculative_config`): the drafts made after each
of a request's outputs, verified as a rejection sampler verifies them at temperature 0 against a model whose
argmax is the script: the longest prefix of drafts equal to the script's next tokens is accepted, then one more
token of the script (the recovered token after a rejection, the bonus token when all were accepted).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from engine.config import ScriptedModel, SpeculativeConfig
from engine.core.sched.output import ScheduledRequest
from engine.events import EventLog, SpecVerified
from engine.request import Request

Script = Mapping[str, Sequence[int]] | Callable[[Request], int]
__all__ = ["ScriptedModel", "Script", "TokenScript"]  # ScriptedModel lives in engine/config.py (no import cycle)


class TokenScript:
    """Owns a script and answers, for a request about to sample, which token it samples (and which drafts follow)."""

    def __init__(self, script: Script | ScriptedModel, eos_token_id: int | None, vocab_size: int) -> None:
        self.drafts: Mapping[str, Sequence[Sequence[int]]] = {}
        if isinstance(script, ScriptedModel):
            self.drafts = script.drafts
            script = script.tokens
        self.script = script  # checked by EngineConfig (check_token_script)
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size

    def next_token(self, request: Request) -> int:
        return self.token_at(request, request.num_output_tokens)

    def token_at(self, request: Request, i: int) -> int:
        """Output token i of the request (a callable script is asked for the next one only)."""
        token: int | None
        if callable(self.script):
            token = self.script(request)
        else:
            tokens = self.script.get(request.request_id, ())
            token = tokens[i] if i < len(tokens) else self.eos_token_id
        if token is None or isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
            raise ValueError(
                f"token_script: request {request.request_id!r} output {i} is {token!r}, not a token id in "
                f"[0, {self.vocab_size})"
            )
        return token

    def verify(self, request: Request, drafts: Sequence[int]) -> tuple[list[int], int]:
        """The tokens a greedy verification of `drafts` emits (the accepted ones, then the script's next token) and
        how many drafts were accepted."""
        start = request.num_output_tokens
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == self.token_at(request, start + accepted):
            accepted += 1
        return [self.token_at(request, start + j) for j in range(accepted + 1)], accepted

    def propose(self, request_id: str, num_output_tokens: int, k: int) -> list[int]:
        """The scripted drafts (up to k) once the request has `num_output_tokens` outputs."""
        drafts = self.drafts.get(request_id, ())
        return list(drafts[num_output_tokens][:k]) if num_output_tokens < len(drafts) else []

    def speculate(
        self,
        scheduled: list[ScheduledRequest],
        sampled: dict[str, list[int]],
        spec: SpeculativeConfig,
        events: EventLog,
        num_spec_tokens: int | None = None,
    ) -> dict[str, tuple[list[int], None]]:
        """A step's verifications and proposals: each sampling request's drafts verified (its tokens in `sampled`
        replaced by what the verification emits, a spec.verified event each), then its next drafts (at most
        `num_spec_tokens`, the step's by a dynamic schedule; None: num_speculative_tokens), by request id."""
        k = spec.num_speculative_tokens if num_spec_tokens is None else num_spec_tokens
        proposed: dict[str, tuple[list[int], None]] = {}
        for s in scheduled:
            if not s.samples:
                continue
            if s.spec_token_ids:
                sampled[s.request_id] = self._verify(s, spec.method, events)
            drafts = self.propose(s.request_id, s.request.num_output_tokens + len(sampled[s.request_id]), k)
            if drafts:
                proposed[s.request_id] = (drafts, None)
        return proposed

    def _verify(self, s: ScheduledRequest, method: str, events: EventLog) -> list[int]:
        tokens, accepted = self.verify(s.request, s.spec_token_ids)
        start = s.request.num_output_tokens
        targets = tuple(self.token_at(s.request, start + j) for j in range(len(s.spec_token_ids)))
        events.emit(
            SpecVerified,
            request_id=s.request_id,
            draft_token_ids=tuple(s.spec_token_ids),
            accepted=tuple(j < accepted for j in range(len(s.spec_token_ids))),
            p_target=tuple(1.0 if d == t else 0.0 for d, t in zip(s.spec_token_ids, targets)),
            p_draft=None,
            emitted_token=tokens[-1],
            bonus=accepted == len(s.spec_token_ids),
            method=method,
            rule="greedy",
            target_argmax=targets,
        )
        return tokens
