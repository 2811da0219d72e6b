"""Text <-> token ids for a checkpoint, built on the `tokenizers` library, plus chat templating."""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Encoding, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from engine.errors import InvalidRequestError
from engine.gguf_file import GGUFFile

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types in `tokenizer.ggml.token_type`

# Control tokens that end a turn or a document; llama.cpp stops on these too (its "end of generation" set).
_END_OF_TURN_TOKENS = frozenset(
    {"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>"}
)

# llama.cpp `tokenizer.ggml.pre` -> the HF pre-tokenizer that splits text the same way. 'smollm', 'starcoder'
# and 'refact' isolate every digit before the GPT-2 regex (HF: Digits(individual_digits) + ByteLevel).
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact")
_GPT2 = ("gpt-2", "default")


class Tokenizer:
    """A checkpoint's tokenizer: encode/decode, its special ids and its chat template.

    Build with `load` (a .gguf file or a Hugging Face directory). `encode` adds BOS only if the
    checkpoint asks for it (`add_bos_token`); `stop_token_ids` are the ids that end generation by default.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        eos_token_id: int,
        bos_token_id: int | None,
        stop_token_ids: frozenset[int],
        special_token_ids: frozenset[int],
        chat_template: str | None,
        max_token_chars: int | None = None,
    ) -> None:
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.stop_token_ids = stop_token_ids | {eos_token_id}
        self.special_token_ids = special_token_ids
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        self._token_texts: dict[int, str] = {}  # token_text's: at most the vocabulary
        # the most characters one token covers, where that bounds a text's token count (fewest_tokens)
        self.max_token_chars = max_token_chars

    @property
    def backend(self) -> Backend:
        """The `tokenizers` tokenizer underneath (engine/grammar.py reads its vocabulary)."""
        return self._backend

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """A `.gguf` file -> `from_gguf`; a directory -> `from_hf_dir`."""
        path = Path(path)
        if path.is_dir():
            return cls.from_hf_dir(path)
        if path.suffix == ".gguf":
            return cls.from_gguf(path)
        raise ValueError(f"cannot load a tokenizer from {path}: expected a .gguf file or a directory")

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build a byte-level BPE tokenizer from a GGUF file's vocabulary and merges (metadata only).

        Raises ValueError for vocabularies other than llama.cpp's 'gpt2' (byte-level BPE)
        or for a pre-tokenizer this module does not know.
        """
        meta = GGUFFile(path).fields
        kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE)")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]]
        backend = Backend(
            models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False)
        )
        backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        control = [i for i, t in enumerate(types) if t == _CONTROL]
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
        user_defined = [i for i, t in enumerate(types) if t == _USER_DEFINED]
        if user_defined:  # llama.cpp matches these whole too, but they are not special
            backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user_defined])

        bos_id: int | None = meta.get("tokenizer.ggml.bos_token_id")
        eos_id: int = meta["tokenizer.ggml.eos_token_id"]
        if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
            bos = tokens[bos_id]
            backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
        stops = {meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta}
        stops |= {i for i in control if tokens[i] in _END_OF_TURN_TOKENS}
        return cls(
            backend,
            eos_token_id=eos_id,
            bos_token_id=bos_id,
            stop_token_ids=frozenset(stops),
            special_token_ids=frozenset(control),
            chat_template=meta.get("tokenizer.chat_template"),
            # byte-level: a token covers its spelling's bytes, every byte is in the alphabet, and
            # nothing normalizes the text first, so no token covers more characters than this
            max_token_chars=max(len(t) for t in tokens),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json`, with `tokenizer_config.json` (chat template, bos/eos) and, if present,
        `chat_template.jinja` and `generation_config.json` (extra eos ids, which become stop ids).

        Raises ValueError if no eos token can be determined.
        """
        path = Path(path)
        backend = Backend.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")

        def token_id(entry: Any) -> int | None:
            content = entry.get("content") if isinstance(entry, Mapping) else entry
            return backend.token_to_id(content) if isinstance(content, str) else None

        gen_eos = generation.get("eos_token_id")
        gen_eos_ids = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        eos_id = token_id(config.get("eos_token"))
        if eos_id is None:
            if not gen_eos_ids:
                raise ValueError(f"{path}: no eos token in tokenizer_config.json or generation_config.json")
            eos_id = gen_eos_ids[0]
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        added = backend.get_added_tokens_decoder()
        special = frozenset(i for i, token in added.items() if token.special)
        stops = set(gen_eos_ids) | {i for i in special if added[i].content in _END_OF_TURN_TOKENS}
        return cls(
            backend,
            eos_token_id=eos_id,
            bos_token_id=token_id(config.get("bos_token")),
            stop_token_ids=frozenset(stops),
            special_token_ids=special,
            chat_template=template,
        )

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on `encode(text)`'s length, in O(1): 0 where this tokenizer gives none (a
        vocabulary that may make one unknown token of a whole word, a normalizer that may shrink
        the text)."""
        return -(-len(text) // self.max_token_chars) if self.max_token_chars else 0

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token text such as `<|im_start|>` maps to its single id."""
        ids: list[int] = self._encoding(text).ids
        return ids

    def _encoding(self, text: str) -> Encoding:
        """The backend's encoding of `text`, made with the GIL released: its `encode` holds it, and
        a 2 MB prompt tokenized on a router's thread stalled its event loop, and every stream it
        sends, for 0.65 s; `encode_batch` gives the same ids and offsets."""
        enc: Encoding = self._backend.encode_batch([text], add_special_tokens=True)[0]
        return enc

    def encode_marking(
        self, text: str, marks: Sequence[tuple[int, int]]
    ) -> tuple[list[int], tuple[tuple[int, int], ...]]:
        """`encode(text)`, and for each of `marks` (sorted, disjoint character spans [start, end)
        of `text`) the span [start, end) of the tokens that lie wholly inside it; a mark with no
        whole token in it gives none."""
        enc = self._encoding(text)
        offsets = enc.offsets  # a new list on every read of the attribute: read once
        starts = [s for s, _ in offsets]
        spans: list[tuple[int, int]] = []
        for begin, end in marks:
            first = k = bisect.bisect_left(starts, begin)
            while k < len(starts) and offsets[k][1] <= end:
                k += 1
            if k > first:
                spans.append((first, k))
        return list(enc.ids), tuple(spans)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that do not form whole UTF-8 characters come out as U+FFFD."""
        text: str = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (what a logprobs entry names), remembered:
        an 8K-token echo with 20 alternatives a position names ~170K tokens, 0.24 s decoded one
        by one."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (byte-level spelling) of `token_id`, or None if out of range."""
        token: str | None = self._backend.id_to_token(token_id)
        return token

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """Render `messages` with the checkpoint's chat template, the way Hugging Face does;
        `variables`: more for the template (HF's and vLLM's chat_template_kwargs; the messages,
        the generation prompt and the special tokens are this method's).

        Raises InvalidRequestError(param="messages") for an empty or malformed list, a template that
        rejects the conversation, or a checkpoint without a template.
        """
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt", param="messages")
        _validate_messages(messages)
        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        special = {
            "bos_token": self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else "",
            "eos_token": self.id_to_token(self.eos_token_id) or "",
        }
        given = {
            **(variables or {}),
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            **special,
        }
        return self._template.render(**given)


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2:
        return byte_level
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _validate_messages(messages: object) -> None:
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object", param="messages")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise InvalidRequestError(f"messages[{i}].{key} must be a string", param="messages")


def _raise_exception(message: str) -> NoReturn:
    raise InvalidRequestError(message, param="messages")


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    # Same settings as transformers' chat templating, so templates render byte-for-byte alike.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
