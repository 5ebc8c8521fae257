"""Pydantic request and response models of the OpenAI-compatible HTTP API (the subset reconfig serves)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator,
)

MAX_SEED = (1 << 64) - 1   # the worker protocol carries seeds as uint64
MAX_TOP_K = (1 << 31) - 1  # ... and top_k as int32


def _check_utf8(text: str) -> str:
    # JSON may carry lone surrogates ("\ud800"), which no tokenizer can encode.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from exc
    return text


# Request models: as OpenAI, an unknown argument is a 400, not silently ignored; strict, as the schema says: JSON
# `true` is not the token id 1 and "16" is not the count 16 (pydantic's lax mode would coerce both).
REQUEST_CONFIG = ConfigDict(extra="forbid", strict=True)

Text = Annotated[str, AfterValidator(_check_utf8)]
TokenIds = list[Annotated[int, Field(ge=0)]]
StopStrings = Text | list[Annotated[Text, Field(min_length=1)]] | None


def _only(*allowed: Any, message: str) -> AfterValidator:
    """A validator for an OpenAI option reconfig does not implement: only its neutral values pass."""

    def check(value: Any) -> Any:
        if value not in allowed:
            raise ValueError(message)
        return value

    return AfterValidator(check)


class StreamOptions(BaseModel):
    """Options of a streamed response."""

    model_config = REQUEST_CONFIG

    include_usage: bool = False  # one more chunk before [DONE]: empty choices, the request's usage


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions; unsupported OpenAI options must keep their defaults."""

    model_config = REQUEST_CONFIG

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K, description="extension: -1 or 0 disables")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: StopStrings = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, _only(1, message="only n=1 is supported")] = 1
    presence_penalty: Annotated[float | None, _only(None, 0.0, message="presence_penalty is not supported")] = None
    frequency_penalty: Annotated[float | None, _only(None, 0.0, message="frequency_penalty is not supported")] = None
    logit_bias: Annotated[dict[str, float] | None, _only(None, {}, message="logit_bias is not supported")] = None
    ignore_eos: bool = Field(False, description="extension: keep generating past end-of-sequence tokens")
    user: str | None = None

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt_param: ClassVar[str] = "prompt"  # the field errors about the prompt name

    prompt: Text | TokenIds | list[Text] | list[TokenIds]
    max_tokens: int | None = Field(None, ge=1)
    echo: Annotated[bool, _only(False, message="echo is not supported")] = False
    logprobs: Annotated[int | None, _only(None, message="logprobs is not supported")] = None
    best_of: Annotated[int | None, _only(None, 1, message="only best_of=1 is supported")] = None
    suffix: Annotated[str | None, _only(None, "", message="suffix is not supported")] = None

    @property
    def requested_max_tokens(self) -> int | None:
        """max_tokens as the client sent it."""
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The field that set requested_max_tokens."""
        return "max_tokens"


class TextContentPart(BaseModel):
    """One text part of a message's content."""

    model_config = REQUEST_CONFIG

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = REQUEST_CONFIG

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart]
    name: Text | None = None

    @property
    def text(self) -> str:
        """The content as one string; text parts are joined by newlines."""
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    prompt_param: ClassVar[str] = "messages"

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: Annotated[bool | None, _only(None, False, message="logprobs is not supported")] = None
    top_logprobs: Annotated[int | None, _only(None, message="top_logprobs is not supported")] = None

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, or the deprecated max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The field that set requested_max_tokens."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class UsageInfo(BaseModel):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length"]


class CompletionChoice(BaseModel):
    """One choice of a completion (or of one streamed chunk of it)."""

    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    """A whole completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(BaseModel):
    """One `data:` event of a streamed completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class AssistantMessage(BaseModel):
    """The generated message."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    """A whole chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    """What one streamed chat chunk adds to the message; the first carries the role."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # As OpenAI: a delta names only what it adds ({"content": "..."}; the last one is {}).
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """One served model (/v1/models)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "reconfig"
    max_model_len: int


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    """The body of an OpenAI error."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error response: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo

