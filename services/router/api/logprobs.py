"""Logprobs in OpenAI's shapes: the legacy completions object (tokens, token_logprobs, top_logprobs, text_offset)
and chat's `logprobs.content`.

The values are the workers' raw logprobs: the log-softmax of the model's logits before logit bias, penalties and
temperature (vLLM's default), so they score the model's own distribution whatever the sampling options.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.contracts.step import TokenLogprob
from services.model.tokenizer import Tokenizer
from services.router.api.protocol import (
    ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs,
)

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


def _value(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token as text (special tokens included)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Tokenizer, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None], text_offset: int = 0,
) -> CompletionLogprobs:
    """The legacy object for `token_ids`; logprobs[i] None for a token without one (the prompt's first). Each
    position's top_logprobs holds its alternatives and the chosen token."""
    tokens = [token_text(tokenizer, token_id) for token_id in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(text_offset)
        text_offset += len(text)
    top: list[dict[str, float] | None] = []
    for token, logprob in zip(tokens, logprobs, strict=True):
        if logprob is None:
            top.append(None)
            continue
        alternatives = {token_text(tokenizer, t): _value(value) for t, value in logprob.top}
        alternatives.setdefault(token, _value(logprob.logprob))
        top.append(alternatives)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=[None if p is None else _value(p.logprob) for p in logprobs],
        top_logprobs=top, text_offset=offsets,
    )


def _top(tokenizer: Tokenizer, token_id: int, logprob: float) -> ChatTopLogprob:
    text = token_text(tokenizer, token_id)
    return ChatTopLogprob(token=text, logprob=_value(logprob), bytes=list(text.encode("utf-8", errors="replace")))


def chat_logprobs(tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob]) -> ChatLogprobs:
    """Chat's `logprobs` for generated tokens: each token, its logprob and bytes, and its top alternatives."""
    content = []
    for logprob in logprobs:
        chosen = _top(tokenizer, logprob.token_id, logprob.logprob)
        content.append(ChatTokenLogprob(**chosen.model_dump(),
                                        top_logprobs=[_top(tokenizer, t, value) for t, value in logprob.top]))
    return ChatLogprobs(content=content)
