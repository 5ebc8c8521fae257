"""The OpenAI-compatible HTTP front end of the router: completions, chat, models, health, readiness, metrics."""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from services.contracts.step import SamplingParams
from services.router.api.chat import chat_prompt
from services.router.api.choices import ChatFormat, CompletionFormat, Prompt
from services.router.api.errors import ApiError, error_response, install_error_handlers
from services.router.api.fanout import gather_all, merge_events, start_all, summed_usage, with_choice_seed
from services.router.api.limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimitMiddleware, encode_text
from services.router.api.metrics import METRICS_CONTENT_TYPE, ApiMetrics
from services.router.api.protocol import (
    MAX_CHOICES,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    StreamOptions,
    TokenizeRequest,
    TokenizeResponse,
)
from services.router.api.streaming import GenerationRun, guarded_events, sse_event, unless_disconnected
from services.router.contracts import EngineProtocol, GenerationRequest

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "Malformed JSON, bad parameter values, unknown model, prompt longer than the context"),
        (401, "Missing or wrong API key"),
        (413, "Request body larger than the server accepts"),
        (429, "Queue full (see Retry-After)"),
        (500, "Unexpected server error"),
        (503, "Request aborted by the engine"),
    )
}
# One server-sent event, as schema tools read `text/event-stream` before OpenAPI 3.2 (3.2 calls it itemSchema):
# the stream is not one string but events whose `data` is a JSON chunk, an error object, or the final "[DONE]".
SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk, an error object, or [DONE]"},
                   "event": {"type": "string"}},
}
STREAM_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}}, "description": "JSON, or SSE when stream"}
}


@dataclass(frozen=True, slots=True)
class ApiConfig:
    """Settings of the HTTP front end."""

    model_name: str = ""                  # the served model id; "" = engine.model_name
    model_aliases: tuple[str, ...] = ()  # more ids clients may name the served model by
    api_key: str | None = None            # when set, /v1/* needs `Authorization: Bearer <api_key>`
    default_max_tokens: int = 16          # completions without max_tokens (OpenAI's default); chat: rest of the context
    default_temperature: float = 1.0      # OpenAI's default when a request names none
    request_id_prefix: str = ""           # prepended to the "cmpl-..." / "chatcmpl-..." ids
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger request bodies get 413

    def __post_init__(self) -> None:
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1")
        if not 0.0 <= self.default_temperature <= 2.0:
            raise ValueError("default_temperature must be in [0, 2]")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty (or None to disable authentication)")
        if self.max_request_bytes < 1:
            raise ValueError("max_request_bytes must be >= 1")


class BearerAuthMiddleware:
    """Refuses /v1/* requests without `Authorization: Bearer <api_key>` (401, OpenAI-shaped)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            authorization = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(authorization, self._expected):
                error = ApiError(401, "missing or incorrect API key", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OpenAIServing:
    """Turns validated OpenAI requests into engine requests and engine deltas into OpenAI responses."""

    def __init__(self, engine: EngineProtocol, config: ApiConfig, metrics: ApiMetrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.model_ids = tuple(dict.fromkeys((config.model_name or engine.model_name, *config.model_aliases)))
        self.created = int(time.time())

    def _check_model(self, model: str) -> None:
        if model not in self.model_ids:
            raise ApiError(400, f"the model '{model}' does not exist; served: {', '.join(self.model_ids)}",
                           param="model", code="model_not_found")

    async def _prompts(self, prompt: str | Sequence[Any]) -> list[Prompt]:
        """Every prompt of a completions request (one, or a list)."""
        if isinstance(prompt, str):
            return [Prompt(await encode_text(self.engine.tokenizer, prompt), prompt)]
        if prompt and isinstance(prompt[0], str | list):  # a batch of prompts
            return [item for one in prompt for item in await self._prompts(one)]
        return [Prompt(list(prompt))]

    def _check_token_ids(self, token_ids: Sequence[int], param: str, what: str) -> None:
        vocab_size = self.engine.tokenizer.vocab_size
        if any(token_id >= vocab_size for token_id in token_ids):
            raise ApiError(400, f"{what} must be below the vocabulary size {vocab_size}", param=param,
                           code="invalid_value")

    @staticmethod
    def _check_options(body: CompletionRequest | ChatCompletionRequest) -> None:
        """The checks across fields (each error names the field to change)."""
        max_tokens = body.requested_max_tokens
        if isinstance(body, CompletionRequest) and max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens must be at least 1 unless echo is true", param="max_tokens",
                           code="invalid_value")
        if max_tokens is not None and body.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens ({body.min_tokens}) must be at most {body.max_tokens_param} "
                           f"({max_tokens})", param="min_tokens", code="invalid_value")
        if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs to be true", param="top_logprobs", code="invalid_value")

    def _sampling(self, body: CompletionRequest | ChatCompletionRequest, num_logprobs: int | None) -> SamplingParams:
        logit_bias = tuple(sorted((int(token), bias) for token, bias in (body.logit_bias or {}).items()))
        self._check_token_ids([token for token, _ in logit_bias], "logit_bias", "logit_bias token ids")
        return SamplingParams(
            temperature=body.temperature if body.temperature is not None else self.config.default_temperature,
            top_p=body.top_p if body.top_p is not None else 1.0, top_k=max(body.top_k or 0, 0), seed=body.seed,
            presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0, logit_bias=logit_bias, num_logprobs=num_logprobs,
        )

    def _generation_request(
        self, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int], default_max_tokens: int | None,
        request_id: str, sampling: SamplingParams, prompt_logprobs: bool = False,
    ) -> GenerationRequest:
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", param=body.prompt_param)
        self._check_token_ids(prompt_ids, body.prompt_param, "prompt token ids")
        num_prompt_tokens, max_model_len = len(prompt_ids), self.engine.max_model_len
        room = max_model_len - num_prompt_tokens
        max_tokens = body.requested_max_tokens
        if room < (0 if max_tokens == 0 else 1) or (max_tokens is not None and max_tokens > room):
            wanted = f"; {max_tokens} for the completion" if max_tokens is not None else ""
            note = f" ({self.engine.context_note})" if self.engine.context_note else ""
            raise ApiError(
                400, f"this model's maximum context length is {max_model_len} tokens{note}, however you requested "
                f"{num_prompt_tokens} tokens in the prompt{wanted}; reduce the prompt or the completion length",
                param=body.prompt_param if room < 1 else body.max_tokens_param, code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        return GenerationRequest(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_ids),
            max_tokens=max_tokens,
            sampling=sampling,
            stop_token_ids=frozenset() if body.ignore_eos else self.engine.tokenizer.eos_token_ids,
            stop_strings=body.stop_strings,
            min_tokens=min(body.min_tokens, max_tokens),
            prompt_logprobs=prompt_logprobs,
        )

    def _fan_out(self, body: CompletionRequest | ChatCompletionRequest, prompts: Sequence[list[int]],
                 default_max_tokens: int | None, kind: str, num_logprobs: int | None,
                 prompt_logprobs: bool = False) -> tuple[str, list[GenerationRequest]]:
        """The response id, and one engine request per choice: n per prompt, choice i of a prompt seeded seed + i."""
        self._check_options(body)
        if len(prompts) * body.n > MAX_CHOICES:
            raise ApiError(400, f"n times the number of prompts is {len(prompts) * body.n}, more than {MAX_CHOICES}",
                           param="n", code="invalid_value")
        response_id = f"{self.config.request_id_prefix}{kind}-{uuid.uuid4().hex}"
        sampling = self._sampling(body, num_logprobs)
        generations = []
        for prompt_ids in prompts:
            generation = self._generation_request(body, prompt_ids, default_max_tokens, response_id, sampling,
                                                  prompt_logprobs)
            generations += [with_choice_seed(generation, i) for i in range(body.n)]
        if len(generations) > 1:
            generations = [replace(g, request_id=f"{response_id}-{i}") for i, g in enumerate(generations)]
        return response_id, generations

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        """POST /v1/completions."""
        self._check_model(body.model)
        prompts = await self._prompts(body.prompt)
        response_id, generations = self._fan_out(
            body, [p.token_ids for p in prompts], self.config.default_max_tokens, "cmpl", body.logprobs,
            prompt_logprobs=body.echo and body.logprobs is not None)
        runs = await start_all(self.engine, generations, self.metrics.request_timer, request)
        header = {"id": response_id, "created": int(time.time()), "model": body.model}
        form = CompletionFormat(self.engine.tokenizer, body.echo, body.logprobs)
        prompt_of = [prompt for prompt in prompts for _ in range(body.n)]
        if body.stream:
            options = body.stream_options or StreamOptions()
            streams = [form.events(i, run, prompt_of[i], header, options) for i, run in enumerate(runs)]
            return _event_stream(merge_events(streams), self._usage_event(runs, body.n, options.include_usage,
                                                                          CompletionChunk(**header, choices=[])))
        results = await unless_disconnected(request, gather_all([run.collect() for run in runs]))
        choices = [form.choice(i, run, text, prompt_of[i]) for i, (run, (text, _, _)) in enumerate(zip(runs, results))]
        response = CompletionResponse(**header, choices=choices, usage=summed_usage(runs, body.n))
        return JSONResponse(response.model_dump())

    @staticmethod
    def _usage_event(runs: list[GenerationRun], num_choices: int, include_usage: bool,
                     usage_chunk: CompletionChunk | ChatCompletionChunk) -> Callable[[], str] | None:
        """The stream's last chunk, with the usage, when the client asked for it (stream_options.include_usage)."""
        if not include_usage:
            return None

        def event() -> str:
            usage_chunk.usage = summed_usage(runs, num_choices)
            return sse_event(usage_chunk, include_usage)

        return event

    async def chat_completion(self, body: ChatCompletionRequest, request: Request) -> Response:
        """POST /v1/chat/completions."""
        self._check_model(body.model)
        text, add_bos = chat_prompt(self.engine.tokenizer, body.messages)
        prompt_ids = await encode_text(self.engine.tokenizer, text, add_bos)
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        # The default completion length: the rest of the context.
        response_id, generations = self._fan_out(body, [prompt_ids], None, "chatcmpl", num_logprobs)
        runs = await start_all(self.engine, generations, self.metrics.request_timer, request)
        header = {"id": response_id, "created": int(time.time()), "model": body.model}
        form = ChatFormat(self.engine.tokenizer, num_logprobs is not None)
        if body.stream:
            options = body.stream_options or StreamOptions()
            streams = [form.events(i, run, header, options) for i, run in enumerate(runs)]
            return _event_stream(merge_events(streams), self._usage_event(runs, body.n, options.include_usage,
                                                                          ChatCompletionChunk(**header, choices=[])))
        results = await unless_disconnected(request, gather_all([run.collect() for run in runs]))
        choices = [form.choice(i, run, text) for i, (run, (text, _, _)) in enumerate(zip(runs, results))]
        response = ChatCompletionResponse(**header, choices=choices, usage=summed_usage(runs, body.n))
        return JSONResponse(response.model_dump())

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """POST /tokenize (vLLM's): the token ids a completions or chat request would get for this prompt."""
        if body.model is not None:
            self._check_model(body.model)
        tokenizer = self.engine.tokenizer
        if body.messages is not None:
            text, add_bos = chat_prompt(tokenizer, body.messages)
        else:
            text, add_bos = body.prompt or "", body.add_special_tokens
        tokens = await encode_text(tokenizer, text, add_bos)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=self.engine.max_model_len)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """POST /detokenize (vLLM's): the text of token ids."""
        if body.model is not None:
            self._check_model(body.model)
        self._check_token_ids(body.tokens, "tokens", "token ids")
        return DetokenizeResponse(prompt=self.engine.tokenizer.decode(body.tokens))

    def models(self) -> ModelList:
        """GET /v1/models."""
        return ModelList(data=[
            ModelCard(id=model_id, created=self.created, max_model_len=self.engine.max_model_len)
            for model_id in self.model_ids
        ])


def _event_stream(events: AsyncIterator[str], last: Callable[[], str] | None = None) -> StreamingResponse:
    return StreamingResponse(guarded_events(events, last), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def create_app(engine: EngineProtocol, config: ApiConfig = ApiConfig()) -> FastAPI:
    """The router's HTTP app over `engine`."""
    app = FastAPI(title="reconfig router", version="1", summary="OpenAI-compatible LLM serving API")
    metrics = ApiMetrics(engine, config.model_name or engine.model_name)
    serving = OpenAIServing(engine, config, metrics)
    app.state.serving = serving
    app.state.metrics = metrics
    install_error_handlers(app)
    if config.api_key is not None:
        app.add_middleware(BearerAuthMiddleware, api_key=config.api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)  # outermost: before the key check

    v1 = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)
    v1.add_api_route("/completions", serving.completion, methods=["POST"], response_model=CompletionResponse,
                     responses=STREAM_RESPONSE, summary="Create a completion")
    v1.add_api_route("/chat/completions", serving.chat_completion, methods=["POST"],
                     response_model=ChatCompletionResponse, responses=STREAM_RESPONSE,
                     summary="Create a chat completion")
    v1.add_api_route("/models", serving.models, methods=["GET"], response_model=ModelList, summary="List models")
    app.include_router(v1)
    # vLLM's tokenizer endpoints (at the root, as vLLM serves them).
    app.add_api_route("/tokenize", serving.tokenize, methods=["POST"], response_model=TokenizeResponse,
                      responses=ERROR_RESPONSES, summary="Tokenize a prompt or chat messages")
    app.add_api_route("/detokenize", serving.detokenize, methods=["POST"], response_model=DetokenizeResponse,
                      responses=ERROR_RESPONSES, summary="Detokenize token ids")

    @app.get("/health", summary="Liveness: 200 while the process serves HTTP")
    async def health() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/ready", summary="Readiness: 200 when workers are up and weights loaded",
             responses={503: {"model": ErrorResponse, "description": "Not ready"}})
    async def ready() -> dict[str, str]:
        if not engine.is_ready:
            raise ApiError(503, "the engine is not ready", "server_error", code="not_ready")
        return {"status": "ready"}

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus_metrics() -> Response:
        if (engine_metrics := getattr(engine, "render_metrics", None)) is not None:  # an API server process: the
            return Response(await engine_metrics(metrics.samples()), media_type=METRICS_CONTENT_TYPE)  # engine
        content, content_type = metrics.render()  # adds up every server's latencies; in process: all here
        return Response(content, media_type=content_type)

    app.openapi = lambda: _openapi_without_422(app)  # type: ignore[method-assign]
    return app


def _openapi_without_422(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI schema without FastAPI's 422 responses: validation errors are 400 here."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
