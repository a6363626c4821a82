"""The Workbench's controls (not views: they draw no record): the add-request form, the engine knobs, and the
worker that steps the engine (Play)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import panel as pn

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams, StructuredOutputsParams

NO_GUIDE, JSON_SCHEMA, REGEX = "none", "JSON schema", "regex"
NO_SPEC = "none"
SPEC_METHODS = (NO_SPEC, "ngram", "draft_model")


def _follow_value(text: pn.widgets.TextInput | pn.widgets.TextAreaInput) -> None:
    """Keep `value_input` (what the browser shows as it is typed; `value` changes only on blur) equal to
    `value` when that is set from code, so reading `value_input` always reads what the user sees."""
    text.value_input = text.value
    text.param.watch(lambda event: setattr(text, "value_input", event.new), "value")


class RequestForm:
    """Owns the add-request widgets (prompt, max tokens, temperature, seed, priority, JSON schema or regex,
    cache salt) and turns what they show (text fields: as typed, before they lose focus) into add_request
    arguments. Validation is the engine's: a bad value raises its ValueError/TypeError, which the Workbench
    shows."""

    def __init__(self) -> None:
        self.prompt = pn.widgets.TextAreaInput(
            label="Prompt", value="The capital of France is", height=70, sizing_mode="stretch_width"
        )
        self.max_tokens = pn.widgets.IntInput(label="Max tokens", value=32, width=120)
        self.temperature = pn.widgets.FloatInput(label="Temperature", value=0.0, step=0.1, width=120)
        self.seed = pn.widgets.IntInput(label="Seed (empty: none)", value=None, width=120)
        self.priority = pn.widgets.IntInput(label="Priority", value=0, width=120)
        self.guide_kind = pn.widgets.Select(label="Guided decoding", options=[NO_GUIDE, JSON_SCHEMA, REGEX], width=120)
        self.guide = pn.widgets.TextAreaInput(label="JSON schema or regex", height=60, sizing_mode="stretch_width")
        self.cache_salt = pn.widgets.TextInput(label="Cache salt (empty: none)", sizing_mode="stretch_width")
        for text in (self.prompt, self.guide, self.cache_salt):
            _follow_value(text)
        self.button = pn.widgets.Button(label="Add request", color="primary")
        self.panel = pn.Column(
            self.prompt,
            pn.Row(self.max_tokens, self.temperature),
            pn.Row(self.seed, self.priority),
            self.guide_kind,
            self.guide,
            self.cache_salt,
            self.button,
            sizing_mode="stretch_width",
        )

    def sampling_params(self) -> SamplingParams:
        # An emptied number field is None: SamplingParams checks its fields' types when built and raises the
        # TypeError the Workbench shows, so the value goes to it as the field holds it.
        return SamplingParams(
            temperature=cast(float, self.temperature.value),
            seed=self.seed.value,
            max_tokens=cast(int, self.max_tokens.value),
            structured_outputs=self._structured(),
        )

    def _structured(self) -> StructuredOutputsParams | None:
        kind, text = self.guide_kind.value, (self.guide.value_input or "").strip()
        if kind == NO_GUIDE:
            return None
        if not text:
            raise ValueError(f"structured_outputs: the {kind} is empty")
        if kind == JSON_SCHEMA:
            try:
                return StructuredOutputsParams(json=json.loads(text))
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json: not valid JSON ({exc})") from None
        return StructuredOutputsParams(regex=text)

    def add_request_args(self) -> dict[str, Any]:
        """The keyword arguments of LLMEngine.add_request that the form describes."""
        return {
            "prompt": self.prompt.value_input,
            "params": self.sampling_params(),
            "priority": self.priority.value,
            "cache_salt": self.cache_salt.value_input or None,
        }


class EngineForm:
    """Owns the engine knobs (block size, token budget, long-prefill threshold, KV blocks, prefix caching,
    speculative method and k) and builds the EngineConfig they describe on top of the running one."""

    def __init__(self, config: EngineConfig) -> None:
        self.block_size = pn.widgets.IntInput(label="Block size", width=120)
        self.budget = pn.widgets.IntInput(label="Token budget", width=120)
        self.long_prefill = pn.widgets.IntInput(label="Long-prefill threshold", width=120)
        self.num_kv_blocks = pn.widgets.IntInput(label="KV blocks", width=120)
        self.prefix_caching = pn.widgets.Checkbox(label="Prefix caching")
        self.spec_method = pn.widgets.Select(label="Speculative method", options=list(SPEC_METHODS), width=120)
        self.spec_k = pn.widgets.IntInput(label="Draft tokens k", value=3, width=120)
        self.button = pn.widgets.Button(label="Rebuild engine", color="warning")
        self.show(config)
        self.panel = pn.Column(
            pn.Row(self.block_size, self.budget),
            pn.Row(self.long_prefill, self.num_kv_blocks),
            self.prefix_caching,
            pn.Row(self.spec_method, self.spec_k),
            self.button,
            sizing_mode="stretch_width",
        )

    def show(self, config: EngineConfig) -> None:
        """Set the knobs to a config's values."""
        self.block_size.value = config.block_size
        self.budget.value = config.max_num_batched_tokens
        self.long_prefill.value = config.long_prefill_token_threshold
        self.num_kv_blocks.value = config.num_kv_blocks
        self.prefix_caching.value = config.enable_prefix_caching
        spec = config.speculative_config or {}
        self.spec_method.value = spec.get("method", NO_SPEC)
        self.spec_k.value = spec.get("num_speculative_tokens", self.spec_k.value)

    def config(self, base: EngineConfig) -> EngineConfig:
        """`base` with the knobs' values; EngineConfig validates them (ValueError/TypeError naming the field)."""
        spec = None
        if self.spec_method.value != NO_SPEC:
            spec = {"method": self.spec_method.value, "num_speculative_tokens": self.spec_k.value}
        return EngineConfig(
            **{
                **base.to_dict(),
                "block_size": self.block_size.value,
                "max_num_batched_tokens": self.budget.value,
                "long_prefill_token_threshold": self.long_prefill.value,
                "num_kv_blocks": self.num_kv_blocks.value,
                "enable_prefix_caching": self.prefix_caching.value,
                "speculative_config": spec,
            }
        )


class Stepper:
    """Owns the worker thread that steps the engine off the UI thread: steps asked for (Step, Run) and
    Play, which steps until paused. `step_once` does one step under the engine lock and returns False to stop
    (nothing left to run, or an error)."""

    def __init__(self, step_once: Callable[[], bool], delay_s: float = 0.0) -> None:
        self.step_once = step_once
        self.delay_s = delay_s
        self._guard = threading.Lock()  # pending, playing and the thread handle change together
        self._pending = 0
        self._playing = False
        self._thread: threading.Thread | None = None

    @property
    def is_busy(self) -> bool:
        return self._thread is not None

    def run(self, num_steps: int) -> None:
        with self._guard:
            self._pending += num_steps
            self._start()

    def play(self) -> None:
        with self._guard:
            self._playing = True
            self._start()

    def pause(self) -> None:
        with self._guard:
            self._playing, self._pending = False, 0

    def join(self, timeout: float | None = None) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="workbench-stepper", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._guard:
                if self._pending > 0:
                    self._pending -= 1
                elif not self._playing:
                    self._thread = None
                    return
                playing = self._playing
            if not self.step_once():
                self.pause()
            elif playing and self.delay_s:
                time.sleep(self.delay_s)  # Play at a pace the eye (and the browser) can follow
