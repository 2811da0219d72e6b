"""Structured output (OpenAI's `response_format`: `json_object`, `json_schema`; vLLM's
`guided_json`, `guided_regex`, `guided_choice`): a guided request samples, at each step, only
tokens its grammar allows there.

xgrammar (PyPI) does the grammar work: it compiles a JSON schema (`{"type": "object"}` for
`json_object`) against the tokenizer's vocabulary, and a request's matcher (a pushdown automaton) gives the
tokens allowed next as a bitmask, in microseconds. `allowed_tokens` turns the step's masks into
one boolean tensor for the sampler (engine/sampler.py), which keeps a row's logprobs the
model's, as it does under penalties. The engine advances a request's matcher with each token it
emits (and, for a replay, with the tokens it carries): a guided answer ends with "stop" where
its grammar is complete, and where the model picks an end-of-sequence token, which the grammar
allows only there. A guided request's speculative draft is cut to its grammatical prefix
(`grammatical`), and each position of it samples under the mask of the state after the draft
tokens before it, so speculation keeps a guided answer exact (engine/speculation.py).

xgrammar is installed without its declared dependencies (Makefile): triton serves its CUDA
kernels, and nothing here uses them. Without it a guided request is refused
(InvalidRequestError), and nothing else changes.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAX_SPEC_CHARS = 64 * 1024
# what xgrammar puts before its reason: "[15:43:25] /project/cpp/regex_converter.cc:94: "
_XGRAMMAR_SOURCE = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@dataclass(frozen=True)
class Guide:
    """What a guided request's output must be: a JSON object ("json", OpenAI's `json_object`),
    JSON that a schema accepts ("json_schema"; `spec` is the schema's JSON text), text that a
    regular expression matches whole ("regex"; `spec` is the pattern, xgrammar's dialect, as
    vLLM's `guided_regex` and `guided_choice`), or text a grammar derives ("grammar"; `spec` in
    xgrammar's EBNF, llama.cpp's GBNF: `root ::= ...`, as vLLM's `guided_grammar`). JSON is
    written compact, with ", " and ": " between items, as `json.dumps` writes it."""

    kind: Literal["json", "json_schema", "regex", "grammar"]
    spec: str = ""
    field: str = "response_format"  # the request's field that asked for it, which an error names

    def __post_init__(self) -> None:
        if self.kind not in ("json", "json_schema", "regex", "grammar"):
            why = f"unknown guide {self.kind!r}: json, json_schema, regex or grammar"
            raise InvalidRequestError(why, "response_format")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"the {self.kind} guide is over {MAX_SPEC_CHARS} characters", "response_format")
        if self.kind == "json_schema":
            try:
                json.loads(self.spec)
            except ValueError as e:
                raise InvalidRequestError(f"the JSON schema is not JSON: {e}", "response_format") from None

    @classmethod
    def choice(cls, options: Sequence[str]) -> Guide:
        """Exactly one of `options` (vLLM's `guided_choice`)."""
        if not options or not all(isinstance(o, str) and o for o in options):
            raise InvalidRequestError("guided_choice needs a list of non-empty strings", "guided_choice")
        return cls("regex", "|".join(f"({_escaped(o)})" for o in options))


def _escaped(text: str) -> str:
    """`text` as a regular expression that matches it (xgrammar's dialect: only its special
    characters escaped; it warns on others, as on Python's escaped spaces)."""
    return "".join("\\" + c if c in _SPECIAL else c for c in text)


_SPECIAL = frozenset("\\.^$*+?()[]{}|")


class Grammars:
    """One engine's grammar compiler: the tokenizer's vocabulary as xgrammar reads it (built on
    the first guided request, ~0.2 s here) and the grammars it compiled (cached by xgrammar)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: Any = None
        self._building = threading.Lock()

    def matcher(self, guide: Guide) -> Any:
        """A fresh matcher for `guide`. Raises InvalidRequestError where it cannot be had: no
        tokenizer, no xgrammar, or a schema xgrammar refuses."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compiled(guide))

    def compiled(self, guide: Guide) -> Any:
        """`guide`'s grammar, compiled once (xgrammar caches it by schema: 8-100 ms for schemas
        of 0.6-35K characters here, then under 1 ms), so a worker compiles it before it takes the
        engine's lock (`Engine.prepare`), not while every stream waits. Raises InvalidRequestError."""
        compiler = self._compiler or self._new_compiler()
        try:
            if guide.kind == "regex":
                return compiler.compile_regex(guide.spec)
            if guide.kind == "grammar":
                return compiler.compile_grammar(guide.spec)
            schema = guide.spec if guide.kind == "json_schema" else '{"type": "object"}'
            # whitespace only in the separators: a free run of it is where small models loop
            return compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))
        except Exception as e:  # xgrammar raises RuntimeError (or its own) on what it cannot use
            why = _XGRAMMAR_SOURCE.sub("", (str(e).strip().splitlines() or [type(e).__name__])[0])
            raise InvalidRequestError(f"the {guide.kind} guide cannot be used: {why[:300]}", guide.field) from None

    def _new_compiler(self) -> Any:
        """Built once, by the first guided request, while any others that came with it wait: each
        built its own (1-2 s of the GIL apiece, importing transformers and copying the tokenizer),
        and a worker hit by a burst of them answered no ping for over 3 s and was given up for dead."""
        with self._building:
            if self._compiler is None:
                self._compiler = self._build_compiler()
            return self._compiler

    def _build_compiler(self) -> Any:
        if self._tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer, so no structured output", "response_format")
        try:
            import xgrammar
            from transformers import PreTrainedTokenizerFast
        except ImportError:
            raise InvalidRequestError(
                "structured output needs xgrammar: pip install --no-deps xgrammar apache-tvm-ffi", "response_format"
            ) from None
        hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)  # type: ignore[no-untyped-call]
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=self._vocab_size, stop_token_ids=sorted(self._tokenizer.stop_token_ids)
        )
        log.info("structured output: xgrammar compiler built (%s vocabulary)", info.vocab_type)
        return xgrammar.GrammarCompiler(info, max_threads=1)


def grammatical(matcher: Any, draft: Sequence[int]) -> tuple[int, ...]:
    """The longest prefix of `draft` that `matcher`'s grammar allows from where it is, short of
    a stop token that ends it: the row after the prefix samples that one (its mask allows
    nothing else), where a row after it would ask a finished grammar for a mask, which fails the
    whole step. The matcher is left where it was."""
    n = 0
    for token in draft:
        if not matcher.accept_token(token):
            break
        if matcher.is_terminated():
            matcher.rollback(1)
            break
        n += 1
    matcher.rollback(n)
    return tuple(draft[:n])


def allowed_tokens(
    matchers: Sequence[Any], vocab_size: int, device: torch.device, drafted: Sequence[Sequence[int]] = ()
) -> torch.Tensor | None:
    """bool [len(matchers), vocab_size]: the tokens each row may sample next, every token where
    its matcher is None; None where no row is guided. Row i samples after `drafted[i]` (a
    speculative draft's tokens before its position, engine/speculation.py: grammatical ones),
    which its matcher takes in and gives back around the fill."""
    if all(m is None for m in matchers):
        return None
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(matchers), vocab_size)  # int32 [B, ceil(V / 32)], all set
    for i, m in enumerate(matchers):
        if m is not None:
            taken = 0
            try:  # given back whatever happens: a step that fails is run again (engine/containment.py)
                for token in drafted[i] if drafted else ():
                    if not m.accept_token(token):
                        break
                    taken += 1
                m.fill_next_token_bitmask(bitmask, i)
            finally:
                m.rollback(taken)
    bits = torch.arange(32, dtype=torch.int32)
    unpacked = (bitmask.unsqueeze(-1) >> bits) & 1  # [B, W, 32]: bit j of word w is token 32 w + j
    return unpacked.flatten(1)[:, :vocab_size].bool().to(device)
