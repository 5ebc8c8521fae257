"""Byte-level tokenizer of the built-in presets and the tokenizer wrapper used by the router."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
NUM_BYTE_TOKENS = 256
BOS_TOKEN_ID = 256
EOS_TOKEN_ID = 257
PAD_TOKEN_ID = 258
NUM_TOKENS = 259  # byte tokens + special tokens; model vocabularies pad past this

# One `<|role|>` line per message, then `<|assistant|>` when a reply is wanted. Only
# expressions, so no whitespace control is needed and Jinja and transformers render alike.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_REPLACEMENT_CHAR = "\ufffd"


def byte_to_unicode() -> list[str]:
    """The ByteLevel alphabet: the printable character standing for each byte 0..255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    is_printable = set(printable)
    characters = []
    num_remapped = 0
    for byte in range(NUM_BYTE_TOKENS):
        if byte in is_printable:
            characters.append(chr(byte))
        else:
            characters.append(chr(NUM_BYTE_TOKENS + num_remapped))
            num_remapped += 1
    return characters


def build_byte_level_tokenizer() -> tokenizers.Tokenizer:
    """A tokenizer with one token per UTF-8 byte (ids 0..255) plus bos, eos and pad."""
    vocab = {character: byte for byte, character in enumerate(byte_to_unicode())}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: the whole text is one word, so BPE without merges yields one token per byte.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS_TOKEN, EOS_TOKEN, PAD_TOKEN])  # ids 256, 257, 258
    # transformers' encode(add_special_tokens=True) prepends bos, as Llama 3 tokenizers do.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B:1",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    return tokenizer


def write_tokenizer_files(directory: Path, model_max_length: int) -> None:
    """Write tokenizer.json and tokenizer_config.json of the byte-level tokenizer into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    build_byte_level_tokenizer().save(str(directory / "tokenizer.json"), pretty=True)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(item) for item in value]


def _token_content(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _read_chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    template_file = model_dir / "chat_template.jinja"  # where transformers >= 4.50 saves it
    if template_file.is_file():
        return template_file.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default", next(iter(named.values()), None))
    return template


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the bos/eos/chat-template facts of one checkpoint directory."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        is_bos_added: bool,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.eos_token_ids = frozenset(eos_token_ids)
        self.is_bos_added = is_bos_added and bos_token_id is not None
        self.chat_template = chat_template
        added_ids = backend.get_added_tokens_decoder().keys()
        # Added tokens need not be contiguous with the base vocabulary.
        self.vocab_size = max(backend.get_vocab_size(with_added_tokens=True), max(added_ids, default=-1) + 1)

    @classmethod
    def from_dir(cls, model_dir: Path | str) -> Tokenizer:
        """Load `<model_dir>/tokenizer.json` and the ids named by its config files."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir} (a fast tokenizer file is required)")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        model_config = _read_json(model_dir / "config.json")
        generation_config = _read_json(model_dir / "generation_config.json")

        bos_token = _token_content(tokenizer_config.get("bos_token"))
        bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        if bos_token_id is None and "bos_token" not in tokenizer_config:
            bos_token_id = model_config.get("bos_token_id", generation_config.get("bos_token_id"))
        if "add_bos_token" in tokenizer_config:
            is_bos_added = bool(tokenizer_config["add_bos_token"])
        else:  # e.g. Llama 3: the tokenizer.json post-processor is what adds bos
            probe = backend.encode("a", add_special_tokens=True).ids
            is_bos_added = bos_token_id is not None and probe[:1] == [bos_token_id]

        eos_token_ids: list[int] = []
        eos_token = _token_content(tokenizer_config.get("eos_token"))
        for candidate in (
            *_token_ids(generation_config.get("eos_token_id")),
            *_token_ids(model_config.get("eos_token_id")),
            *([backend.token_to_id(eos_token)] if eos_token else []),
        ):
            if candidate is not None and candidate not in eos_token_ids:
                eos_token_ids.append(candidate)
        chat_template = _read_chat_template(model_dir, tokenizer_config)
        return cls(backend, bos_token_id, eos_token_ids, is_bos_added, chat_template)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`; bos first when asked and the checkpoint uses one (never twice)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos and self.is_bos_added and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids outside the tokenizer's vocabulary (model padding rows) are skipped."""
        known_ids = [token_id for token_id in ids if 0 <= token_id < self.vocab_size]
        return self.backend.decode(known_ids, skip_special_tokens=skip_special_tokens)

    def incremental_decoder(
        self, skip_special_tokens: bool = True, context_ids: Sequence[int] = ()
    ) -> IncrementalDecoder:
        """A streaming decoder over this tokenizer."""
        return IncrementalDecoder(self, skip_special_tokens, context_ids)


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas, holding back incomplete UTF-8 sequences.

    Without context ids (every generated stream) the tokenizers library's DecodeStream does the work, one call per
    token (~1 us, against two whole-window decodes here: ~5 us); the ids it holds back are kept too, so that flush()
    can still show what an unfinished character ends with."""

    def __init__(
        self, tokenizer: Tokenizer, skip_special_tokens: bool = True, context_ids: Sequence[int] = ()
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # context_ids (e.g. the prompt's tail) are already shown; they only fix spacing of what follows.
        self._ids: list[int] = list(context_ids[-4:])
        self._prefix_offset = 0  # ids[prefix_offset:read_offset] were emitted: decoding context
        self._read_offset = len(self._ids)  # ids[read_offset:] are not emitted yet
        self._stream = None if context_ids else decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []  # DecodeStream: ids pushed since its last text

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (empty while a character is incomplete)."""
        if self._stream is not None:
            if not 0 <= token_id < self._tokenizer.vocab_size:
                return ""  # as decode() skips it: a model padding row
            text = self._stream.step(self._tokenizer.backend, token_id)
            if text is None:
                self._held.append(token_id)
                return ""
            self._ids = [*self._ids[-3:], *self._held, token_id][-4:]  # the context flush() decodes after
            self._held.clear()
            return text
        self._ids.append(token_id)
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._advance()
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Return whatever is still held back (end of stream), replacement characters included."""
        if self._stream is not None:
            if not self._held:
                return ""
            decode = self._tokenizer.decode
            shown = decode(self._ids, self._skip_special_tokens)
            text = decode(self._ids + self._held, self._skip_special_tokens)[len(shown):]
            self._held.clear()
            return text
        prefix_text, new_text = self._decode_window()
        self._advance()
        return new_text[len(prefix_text) :]

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special_tokens)
        new_text = decode(self._ids[self._prefix_offset :], self._skip_special_tokens)
        return prefix_text, new_text

    def _advance(self) -> None:
        # Keep only the last emitted window as context, so memory and decode cost stay bounded.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
