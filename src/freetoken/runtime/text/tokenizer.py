"""A model directory's tokenizer: encode/decode via `tokenizers`, chat prompts, streaming detokenization.

Reads the same files Hugging Face tokenizers do (tokenizer.json, tokenizer_config.json, an optional
chat_template.jinja, generation_config.json and config.json) without importing transformers or torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from freetoken.errors import FreeTokenError
from freetoken.runtime.json_keys import OBJECT, TOKEN_IDS, JsonObject, read_json
from freetoken.runtime.text.chat_template import render_chat_template

# Template variables the reference renderer fills from the tokenizer's named special tokens.
NAMED_SPECIAL_TOKENS: tuple[str, ...] = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_MAX_ID = 2**32 - 1  # `tokenizers` ids are u32; larger or negative ids would raise inside the library


def _read_optional_json(path: Path) -> dict:
    return read_json(path) if path.is_file() else {}


def _token_text(value: Any, field: str, path: Path) -> str | None:
    """A special token is saved either as a plain string or as an AddedToken dict with `content`."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise FreeTokenError(f"{path}: field {field!r} must be a string or a dict with 'content', got {value!r}")


def _id_list(value: Any, field: str, path: Path) -> list[int]:
    return list(JsonObject({field: value}, str(path)).get(field, TOKEN_IDS, ()))


def _pick_template(value: Any, path: Path) -> str | dict[str, str] | None:
    """Templates are a string, or (older saves) a list of {"name", "template"} entries."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(e, dict) and {"name", "template"} <= set(e) for e in value):
        return {e["name"]: e["template"] for e in value}
    if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        return dict(value)
    raise FreeTokenError(f"{path}: field 'chat_template' must be a string or a list of named templates")


class Tokenizer:
    """Encode, decode and build chat prompts for one model directory."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        special_tokens: dict[str, str] | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | dict[str, str] | None = None,
        extra_special_ids: Iterable[int] = (),
        source: Path | None = None,
    ) -> None:
        self._backend = backend
        self._source = source
        self._special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self._chat_template = chat_template
        vocab = backend.get_vocab(with_added_tokens=True)
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._id_limit = max(vocab.values(), default=-1) + 1
        special = {tok.content for tok in backend.get_added_tokens_decoder().values() if tok.special}
        special.update(self._special_tokens.values())
        ids = {vocab[t] for t in special if t in vocab}
        self._special_token_ids = frozenset(ids | set(extra_special_ids) | set(self._eos_token_ids))

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FreeTokenError(f"tokenizer file not found: {tokenizer_file}")
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the library raises a bare Exception for malformed files
            raise FreeTokenError(f"cannot load {tokenizer_file}: {' '.join(str(exc).split())}") from exc

        config_file = path / "tokenizer_config.json"
        config = _read_optional_json(config_file)
        special = {name: _token_text(config.get(name), name, config_file) for name in NAMED_SPECIAL_TOKENS}
        legacy_map = path / "special_tokens_map.json"
        if "added_tokens_decoder" not in config and legacy_map.is_file():
            # Older saves keep special tokens in a separate file, which then overrides the config.
            for name, value in read_json(legacy_map).items():
                if name in NAMED_SPECIAL_TOKENS:
                    special[name] = _token_text(value, name, legacy_map)

        extra_special: set[int] = set()
        added = JsonObject(config, str(config_file)).get("added_tokens_decoder", OBJECT, {})
        for key, entry in added.items():
            if isinstance(entry, dict) and entry.get("special") and str(key).isdigit():
                extra_special.add(int(key))

        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            # A separate template file (newer saves) takes precedence over the config entry.
            try:
                chat_template: str | dict[str, str] | None = template_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise FreeTokenError(f"cannot read {template_file}: {exc}") from exc
        else:
            chat_template = _pick_template(config.get("chat_template"), config_file)

        gen_file, model_file = path / "generation_config.json", path / "config.json"
        model_config = _read_optional_json(model_file)
        model_eos = model_config.get("eos_token_id")
        if model_eos is None and isinstance(model_config.get("text_config"), dict):
            model_eos = model_config["text_config"].get("eos_token_id")
        eos = _id_list(_read_optional_json(gen_file).get("eos_token_id"), "eos_token_id", gen_file)
        eos += _id_list(model_eos, "eos_token_id", model_file)
        eos_text = special.get("eos_token")
        if eos_text is not None and (eos_id := backend.token_to_id(eos_text)) is not None:
            eos.append(eos_id)

        return cls(
            backend,
            special_tokens={k: v for k, v in special.items() if v is not None},
            eos_token_ids=eos,
            chat_template=chat_template,
            extra_special_ids=extra_special,
            source=path,
        )

    @property
    def backend(self) -> HFTokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of tokens including added ones; a model's embedding may be padded larger."""
        return self._vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Added tokens marked special, the named special tokens, and the EOS ids."""
        return self._special_token_ids

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens (`eos_token`, `pad_token`, ...) that are set, as template variables."""
        return dict(self._special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_template)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        if not 0 <= token_id <= _MAX_ID:
            return None
        return self._backend.id_to_token(token_id)

    def is_known_id(self, token_id: int) -> bool:
        return 0 <= token_id < self._id_limit and self._backend.id_to_token(token_id) is not None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        # Ids the tokenizer does not know (padded model vocab) decode to nothing.
        known = [int(i) for i in ids if 0 <= i < self._id_limit]
        return self._backend.decode(known, skip_special_tokens=skip_special_tokens)

    def chat_template(self, tools: list[dict] | None = None) -> str:
        """The template to use; with several named ones, `tool_use` serves tool requests, else `default`."""
        template = self._chat_template
        if not template:
            where = self._source if self._source is not None else "this tokenizer"
            raise FreeTokenError(f"no chat_template in {where} (tokenizer_config.json, chat_template.jinja)")
        if isinstance(template, str):
            return template
        if tools is not None and "tool_use" in template:
            return template["tool_use"]
        if "default" in template:
            return template["default"]
        names = ", ".join(sorted(template))
        raise FreeTokenError(f"chat_template has several entries and none named 'default': {names}")

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render a prompt; keyword arguments override the special-token variables of the same name."""
        variables = {**self._special_tokens, **kwargs}
        return render_chat_template(
            self.chat_template(tools),
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces, never splitting a UTF-8 character.

    Each push decodes only a short window: ids[prefix:] against ids[prefix:read]. Decoding the few
    tokens before `read` as context keeps decoders that strip or join at boundaries (byte-level
    BPE, SentencePiece leading spaces) consistent with decoding the whole sequence at once.
    Invariant: everything before `read` has been returned; ids before `prefix` are dropped.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty while a character is partial)."""
        if not self._tokenizer.is_known_id(token_id):
            return ""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        # A trailing U+FFFD means the last bytes start a character that later tokens will finish.
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self._ids = self._ids[self._read :]
        self._prefix, self._read = 0, len(self._ids)
        return text[len(before) :]

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character decodes as U+FFFD)."""
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._ids = []
        self._prefix = self._read = 0
        return text[len(before) :]
