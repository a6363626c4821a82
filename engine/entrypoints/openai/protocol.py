"""The OpenAI API's request bodies with vLLM's extras (`vllm/entrypoints/openai/protocol.py`), and its error shape.

Requests are strict: a field of the wrong type, or one the API does not have, is a 400 naming it (a client that
sends `max_tokens: "5"` or `temprature` learns so, rather than getting a default). The limits that need no engine
(engine/limits.py: the seed's range, the size of every list) are in the models, so `/openapi.json` states them and a
request past one is refused by validation, before anything else runs; those an engine sets (n, logprobs,
max_tokens) are checked by serving_engine against its config."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine import limits

# a prompt or a conversation far past any model's context is refused by its size before it is tokenized
MAX_PROMPT_ITEMS = 1 << 17
MAX_MESSAGES = 4096
StopString = Annotated[str, Field(min_length=1, max_length=limits.MAX_STOP_STRING_CHARS)]
TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_PROMPT_ITEMS)]


class OpenAIBaseModel(BaseModel):
    """What every request body shares: unknown fields and wrong types are refused."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class ErrorInfo(BaseModel):
    """OpenAI's error object: what went wrong, its type, the request field at fault, and a code."""

    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """The body of every error reply: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


class StreamOptions(OpenAIBaseModel):
    """`stream_options`: a last chunk with the usage (`include_usage`), or usage on every chunk (vLLM's extra)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIBaseModel):
    """`response_format.json_schema`: the schema the output must validate against."""

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """`response_format`: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` extra: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(OpenAIBaseModel):
    """The fields completions and chat share: the model, sampling, stopping, streaming and vLLM's extras
    (top_k, min_p, repetition_penalty, bad_words, allowed_token_ids, structured_outputs, priority, cache_salt,
    ignore_eos, ...)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    # the ranges SamplingParams checks, stated here too so the schema says them (vLLM's ranges)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=limits.SEED_MIN, le=limits.SEED_MAX)
    stop: StopString | Annotated[list[StopString], Field(max_length=limits.MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=limits.MAX_STOP_TOKEN_IDS)
    n: int = Field(1, ge=1)  # at most the engine's max_num_seqs (checked against its config)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=limits.MAX_LOGIT_BIAS
    )  # token id (as a JSON key, a string) -> bias in [-100, 100]
    user: str | None = None
    # vLLM's extras
    repetition_penalty: float = Field(1.0, gt=0)
    bad_words: list[Annotated[str, Field(min_length=1, max_length=limits.MAX_BAD_WORD_CHARS)]] | None = Field(
        None, max_length=limits.MAX_BAD_WORDS
    )
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=limits.MAX_ALLOWED_TOKEN_IDS)
    priority: int = 0
    cache_salt: str | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    request_id: str | None = None


class CompletionRequest(SamplingRequest):
    """`POST /v1/completions`: one prompt (text or token ids) to continue."""

    # one prompt (a batch of several is refused, naming the field): text, token ids, or either in a list of one
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[TokenIds, Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPT_ITEMS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPT_ITEMS)]
    )
    logprobs: int | None = Field(None, ge=0)  # at most the engine's max_logprobs
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(OpenAIBaseModel):
    """One message of a conversation; content as text or as text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    """`POST /v1/chat/completions`: a conversation, rendered by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # at most the engine's max_logprobs
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True  # vLLM's extra
