"""Pydantic request and response models of the OpenAI-compatible HTTP API (the subset reconfig serves)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator,
)

MAX_SEED = (1 << 64) - 1   # the worker protocol carries seeds as uint64
MAX_TOP_K = (1 << 31) - 1  # ... and top_k as int32
MAX_LOGPROBS = 20          # alternatives per position, as vLLM's default max_logprobs
MAX_CHOICES = 128          # n, and n x prompts of one request, at most (OpenAI's limit of n)


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


def _check_logit_bias(bias: dict[str, float] | None) -> dict[str, float] | None:
    for key in bias or {}:
        if not (key.isascii() and key.isdigit()):
            raise ValueError(f"logit_bias keys must be token ids (strings of digits), got {key!r}")
    return bias


LogitBias = Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None, AfterValidator(_check_logit_bias)]
Penalty = Annotated[float | None, Field(ge=-2.0, le=2.0)]


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
    # vLLM's extension (guidellm sends it): with include_usage, every chunk also carries its choice's usage so far.
    continuous_usage_stats: bool = False

    @property
    def is_continuous(self) -> bool:
        """Whether every chunk carries usage (vLLM ignores continuous_usage_stats without include_usage)."""
        return self.include_usage and self.continuous_usage_stats


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
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices per prompt; a seeded choice i uses seed + i")
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0, description="extension (Hugging Face's)")
    min_tokens: int = Field(0, ge=0, description="extension: no stop token or string before this many tokens")
    logit_bias: LogitBias = None
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
    max_tokens: int | None = Field(None, ge=0, description="0 (with echo): score the prompt, generate nothing")
    echo: bool = Field(False, description="return the prompt before the completion (and its logprobs)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
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
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs: true")

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


class CompletionLogprobs(BaseModel):
    """Logprobs of a completion choice's tokens (the prompt's first, with echo): parallel lists."""

    tokens: list[str]
    token_logprobs: list[float | None]             # None for the prompt's first token
    top_logprobs: list[dict[str, float] | None]    # the most likely tokens there, plus the chosen one
    text_offset: list[int]                         # where each token starts in the choice's text


class CompletionChoice(BaseModel):
    """One choice of a completion (or of one streamed chunk of it)."""

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
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


class ChatTopLogprob(BaseModel):
    """One likely token at a position."""

    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's UTF-8 bytes


class ChatTokenLogprob(ChatTopLogprob):
    """A generated token's logprob and the most likely tokens at its position."""

    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    """Logprobs of a chat choice's tokens."""

    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt, or messages rendered as a chat prompt."""

    model_config = REQUEST_CONFIG
    prompt_param: ClassVar[str] = "prompt"

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = Field(True, description="prompt only: add the bos token")

    @model_validator(mode="after")
    def _check_one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("set exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    """The token ids of a prompt."""

    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's)."""

    model_config = REQUEST_CONFIG

    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    """The text of token ids."""

    prompt: str


class ErrorInfo(BaseModel):
    """The body of an OpenAI error."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error response: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo

