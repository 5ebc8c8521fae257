"""Chat prompts: the checkpoint's template in a sandbox, the plain default, and template failures."""

from __future__ import annotations

import pytest

from services.model.tokenizer import BOS_TOKEN, BOS_TOKEN_ID, CHAT_TEMPLATE, EOS_TOKEN_ID, Tokenizer
from services.model.tokenizer import build_byte_level_tokenizer
from services.router.api.chat import chat_prompt_token_ids, render_chat
from services.router.api.errors import ApiError
from services.router.api.protocol import ChatMessage

CONVERSATION = [
    ChatMessage(role="system", content="Be brief."),
    ChatMessage(role="user", content="Hi"),
    ChatMessage(role="assistant", content="Hello."),
    ChatMessage(role="user", content=[{"type": "text", "text": "Two"}, {"type": "text", "text": "parts"}]),
]


def tokenizer_with(template: str | None) -> Tokenizer:
    return Tokenizer(build_byte_level_tokenizer(), BOS_TOKEN_ID, [EOS_TOKEN_ID], True, chat_template=template)


def test_checkpoint_template_renders_every_message_and_the_generation_prompt():
    text = render_chat(tokenizer_with(CHAT_TEMPLATE), CONVERSATION)
    assert text == ("<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello.\n<|user|>\nTwo\nparts\n"
                    "<|assistant|>\n")


def test_template_prompt_gets_no_extra_bos_but_its_own_bos_token_once():
    tokenizer = tokenizer_with(CHAT_TEMPLATE)
    ids = chat_prompt_token_ids(tokenizer, CONVERSATION[1:2])
    assert ids == tokenizer.encode("<|user|>\nHi\n<|assistant|>\n", add_bos=False)  # as apply_chat_template
    with_bos = tokenizer_with("{{ bos_token }}" + CHAT_TEMPLATE)
    ids = chat_prompt_token_ids(with_bos, CONVERSATION[1:2])
    assert ids[0] == BOS_TOKEN_ID and ids.count(BOS_TOKEN_ID) == 1
    assert render_chat(with_bos, CONVERSATION[1:2]).startswith(BOS_TOKEN)


def test_default_prompt_without_a_template():
    tokenizer = tokenizer_with(None)
    text = render_chat(tokenizer, CONVERSATION[:2])
    assert text == "system: Be brief.\nuser: Hi\nassistant:"
    assert chat_prompt_token_ids(tokenizer, CONVERSATION[:2]) == tokenizer.encode(text)  # with bos


def test_template_refusal_is_a_400():
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
    with pytest.raises(ApiError) as refused:
        render_chat(tokenizer_with(template), CONVERSATION)
    assert refused.value.status_code == 400 and refused.value.info.param == "messages"
    assert "first message must be user" in refused.value.info.message


def test_template_is_sandboxed():
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ApiError) as refused:
        render_chat(tokenizer_with(escape), CONVERSATION)
    assert refused.value.status_code == 400
    unsafe_call = "{{ cycler.__init__.__globals__.os.popen('id').read() }}"
    with pytest.raises(ApiError):
        render_chat(tokenizer_with(unsafe_call), CONVERSATION)


def test_broken_template_is_a_server_error():
    with pytest.raises(ApiError) as broken:
        render_chat(tokenizer_with("{% for message in messages %}"), CONVERSATION)
    assert broken.value.status_code == 500 and broken.value.info.type == "server_error"
