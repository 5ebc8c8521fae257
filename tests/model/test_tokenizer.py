"""Byte-level preset tokenizer, the checkpoint tokenizer wrapper and streaming detokenization."""

import json
from pathlib import Path

import jinja2
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from services.model.tokenizer import (
    BOS_TOKEN_ID,
    CHAT_TEMPLATE,
    EOS_TOKEN_ID,
    NUM_TOKENS,
    PAD_TOKEN_ID,
    IncrementalDecoder,
    Tokenizer,
    build_byte_level_tokenizer,
    byte_to_unicode,
    write_tokenizer_files,
)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi 😀\nthere"},
]
TEXT_CHARACTERS = st.characters(exclude_categories=("Cs",))  # lone surrogates are not encodable text
EXPECTED_CHAT = "<|system|>\nBe brief.\n<|user|>\nHi 😀\nthere\n<|assistant|>\n"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(directory, model_max_length=2048)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


def test_alphabet_is_the_byte_level_alphabet() -> None:
    characters = byte_to_unicode()
    assert len(set(characters)) == 256
    assert set(characters) == set(pre_tokenizers.ByteLevel.alphabet())
    assert characters[ord("a")] == "a" and characters[ord(" ")] == "Ġ"


def test_special_tokens_and_sizes(tokenizer: Tokenizer) -> None:
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID) == (256, 257)
    assert tokenizer.eos_token_ids == frozenset({257})
    assert tokenizer.vocab_size == NUM_TOKENS == 259
    assert tokenizer.backend.token_to_id("<|pad|>") == PAD_TOKEN_ID == 258
    assert tokenizer.chat_template == CHAT_TEMPLATE


@pytest.mark.parametrize("text", ["hello, world", "  two  spaces\n\ttab", "héllo", "😀🎉", "世界你好", ""])
def test_one_token_per_byte_and_round_trip(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == [BOS_TOKEN_ID, *text.encode()]
    assert tokenizer.encode(text, add_bos=False) == list(text.encode())
    assert tokenizer.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(text=st.text(TEXT_CHARACTERS))
def test_round_trip_of_any_text(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_bos=False)
    # Special-token strings in user text become one special token each, as in HF (hypothesis draws them: it mines
    # this module's string constants); test_bos_is_not_doubled and the special-token tests cover that case.
    assume("<|" not in text)
    assert len(ids) == len(text.encode())
    assert tokenizer.decode(ids) == text


def test_bos_is_not_doubled(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("<|begin_of_text|>hi") == [BOS_TOKEN_ID, ord("h"), ord("i")]


def test_decode_skips_padding_ids_and_special_tokens(tokenizer: Tokenizer) -> None:
    ids = [BOS_TOKEN_ID, ord("o"), 300, ord("k"), 319, EOS_TOKEN_ID, -1]
    assert tokenizer.decode(ids) == "ok"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>ok<|end_of_text|>"


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def _checkpoint_dir(path: Path, tokenizer_config: dict | None, config: dict, generation_config: dict | None) -> Path:
    path.mkdir()
    build_byte_level_tokenizer().save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps(config))
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def test_llama3_style_checkpoint(tmp_path: Path) -> None:
    # No add_bos_token: the tokenizer.json post-processor adds bos; generation_config lists several eos.
    directory = _checkpoint_dir(
        tmp_path / "llama3",
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
         "chat_template": [{"name": "default", "template": "A"}, {"name": "tool_use", "template": "B"}]},
        {"bos_token_id": 256, "eos_token_id": 257},
        {"eos_token_id": [258, 257]},
    )
    tokenizer = Tokenizer.from_dir(directory)
    assert tokenizer.encode("a") == [256, ord("a")]
    assert tokenizer.eos_token_id == 258 and tokenizer.eos_token_ids == frozenset({257, 258})
    assert tokenizer.chat_template == "A"
    (directory / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_dir(directory).chat_template == "J"


def test_checkpoint_without_bos(tmp_path: Path) -> None:
    # Qwen2-style: bos_token null in tokenizer_config even though config.json names an id.
    directory = _checkpoint_dir(
        tmp_path / "qwen", {"bos_token": None, "eos_token": "<|end_of_text|>"}, {"bos_token_id": 256}, None
    )
    tokenizer = Tokenizer.from_dir(directory)
    assert tokenizer.bos_token_id is None and tokenizer.chat_template is None
    assert tokenizer.encode("a") == [ord("a")]
    assert tokenizer.eos_token_ids == frozenset({257})


def test_add_bos_token_false_wins(tmp_path: Path) -> None:
    directory = _checkpoint_dir(
        tmp_path / "no_bos", {"bos_token": "<|begin_of_text|>", "add_bos_token": False}, {"eos_token_id": 257}, None
    )
    tokenizer = Tokenizer.from_dir(directory)
    assert tokenizer.bos_token_id == 256 and tokenizer.encode("a") == [ord("a")]


def test_incremental_decoder_holds_back_incomplete_characters(tokenizer: Tokenizer) -> None:
    decoder = tokenizer.incremental_decoder()
    deltas = [decoder.push(token_id) for token_id in "a😀世b".encode()]
    assert deltas == ["a", "", "", "", "😀", "", "", "世", "b"]
    assert decoder.push(EOS_TOKEN_ID) == "" and decoder.push(300) == ""
    assert decoder.push(ord("!")) == "!"
    assert decoder.flush() == ""


def test_incremental_decoder_flushes_a_truncated_character(tokenizer: Tokenizer) -> None:
    decoder = IncrementalDecoder(tokenizer)
    assert [decoder.push(token_id) for token_id in b"x\xf0\x9f"] == ["x", "", ""]
    assert decoder.flush() == "\ufffd"


def test_incremental_decoder_with_context_emits_only_new_text(tokenizer: Tokenizer) -> None:
    decoder = tokenizer.incremental_decoder(context_ids=tokenizer.encode("prompt"))
    assert "".join(decoder.push(token_id) for token_id in b" reply") == " reply"


def test_incremental_decoder_keeps_special_tokens_when_asked(tokenizer: Tokenizer) -> None:
    decoder = tokenizer.incremental_decoder(skip_special_tokens=False)
    assert [decoder.push(token_id) for token_id in (ord("a"), EOS_TOKEN_ID)] == ["a", "<|end_of_text|>"]


@settings(max_examples=80, deadline=None)
@given(data=st.binary(max_size=40) | st.text(TEXT_CHARACTERS, max_size=20).map(str.encode))
def test_streamed_text_equals_full_decode(tokenizer: Tokenizer, data: bytes) -> None:
    decoder = tokenizer.incremental_decoder()
    deltas = [decoder.push(byte) for byte in data]
    streamed = "".join(deltas) + decoder.flush()
    assert streamed == tokenizer.decode(list(data))
    if _is_utf8(data) and not data.decode().endswith("\ufffd"):  # valid text needs no flush
        assert "".join(deltas) == data.decode()


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_chat_template_renders_with_jinja(tokenizer: Tokenizer) -> None:
    template = jinja2.Environment().from_string(tokenizer.chat_template)
    assert template.render(messages=MESSAGES, add_generation_prompt=True) == EXPECTED_CHAT
    assert template.render(messages=MESSAGES, add_generation_prompt=False) == EXPECTED_CHAT.removesuffix(
        "<|assistant|>\n"
    )


def test_chat_template_renders_with_transformers(tokenizer_dir: Path, tokenizer: Tokenizer) -> None:
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == EXPECTED_CHAT
    assert hf_tokenizer("héllo 😀").input_ids == tokenizer.encode("héllo 😀")
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID)
