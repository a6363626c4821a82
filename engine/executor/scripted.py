"""TokenScript: the tokens a model-free engine samples, chosen by whoever drives it.

`executor="scripted"` (or `executor="simulated"` given a `token_script`) runs the engine's real scheduler, KV cache
and prefix cache with no model: every request that samples in a step takes its next token from the script. A script
is `{request_id: [token ids]}` (output token i of a request is its list's item i; past the end of its list, or with
no list, the model's EOS) or a callable `(request) -> token id` (it reads `request.request_id` and
`request.output_token_ids`). EOS and stop tokens in a script end the request as they would from a model, which is
how `workbench fidelity` drives this scheduler side by side with vLLM's own on the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from engine.request import Request

Script = Mapping[str, Sequence[int]] | Callable[[Request], int]


class TokenScript:
    """Owns a script and answers, for a request about to sample, which token it samples."""

    def __init__(self, script: Script, eos_token_id: int | None, vocab_size: int) -> None:
        self.script = script  # checked by EngineConfig (check_token_script)
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size

    def next_token(self, request: Request) -> int:
        token: int | None
        if callable(self.script):
            token = self.script(request)
        else:
            tokens = self.script.get(request.request_id, ())
            i = request.num_output_tokens
            token = tokens[i] if i < len(tokens) else self.eos_token_id
        if token is None or isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
            raise ValueError(
                f"token_script: request {request.request_id!r} output {request.num_output_tokens} "
                f"is {token!r}, not a token id in [0, {self.vocab_size})"
            )
        return token
