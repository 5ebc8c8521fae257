"""Chat prompts: messages rendered with the checkpoint's chat template, or a plain default without one."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.model.tokenizer import Tokenizer
from services.router.api.errors import ApiError
from services.router.api.protocol import ChatMessage


def _raise_exception(message: str) -> NoReturn:
    # Templates call raise_exception("Conversation roles must alternate ...") on conversations they refuse.
    raise jinja2.TemplateError(message)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # The environment transformers' apply_chat_template uses, so prompts match it byte for byte.
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(template)


def _special_token(tokenizer: Tokenizer, token_id: int | None) -> str:
    return (tokenizer.backend.id_to_token(token_id) or "") if token_id is not None else ""


def default_prompt(messages: Sequence[ChatMessage]) -> str:
    """The prompt for a checkpoint without a chat template: one `role: content` line per message, then `assistant:`."""
    return "".join(f"{message.role}: {message.text}\n" for message in messages) + "assistant:"


def render_chat(tokenizer: Tokenizer, messages: Sequence[ChatMessage]) -> str:
    """The prompt text of a conversation, ending where the assistant's reply begins."""
    if tokenizer.chat_template is None:
        return default_prompt(messages)
    conversation: list[dict[str, Any]] = [
        {"role": message.role, "content": message.text, **({"name": message.name} if message.name else {})}
        for message in messages
    ]
    try:
        template = _compile(tokenizer.chat_template)
    except jinja2.TemplateError as exc:  # the checkpoint's fault, not the client's
        raise ApiError(500, f"the model's chat template does not compile: {exc}", "server_error") from exc
    try:
        return template.render(
            messages=conversation,
            add_generation_prompt=True,
            bos_token=_special_token(tokenizer, tokenizer.bos_token_id),
            eos_token=_special_token(tokenizer, tokenizer.eos_token_id),
        )
    except jinja2.TemplateError as exc:
        raise ApiError(400, f"the chat template refused the messages: {exc}", param="messages") from exc


def chat_prompt(tokenizer: Tokenizer, messages: Sequence[ChatMessage]) -> tuple[str, bool]:
    """A conversation's prompt text, and whether bos must be added when it is tokenized."""
    # As transformers' apply_chat_template: a template writes its own bos (if any), so none is added here;
    # the plain default has none, so it gets the checkpoint's bos like any completion prompt.
    return render_chat(tokenizer, messages), tokenizer.chat_template is None


def chat_prompt_token_ids(tokenizer: Tokenizer, messages: Sequence[ChatMessage]) -> list[int]:
    """Token ids of a conversation's prompt."""
    text, add_bos = chat_prompt(tokenizer, messages)
    return tokenizer.encode(text, add_bos=add_bos)
