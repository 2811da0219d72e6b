"""A prompt's text to token ids for the router: refused early where it cannot fit the context,
and tokenized with the spans of a chat's earlier answers."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine.errors import InvalidRequestError, PromptTooLongError
from router.backend import ModelInfo
from router.errors import REQUEST_ID, APIError

log = logging.getLogger("tandem.router")


@dataclass(frozen=True)
class PromptTokens:
    """A request's prompt as token ids, and the spans of its earlier answers (chat only)."""

    ids: list[int]
    decoded: tuple[tuple[int, int], ...] = ()  # SamplingParams.decoded
    decoded_as_prompt: bool = False  # SamplingParams.decoded_as_prompt

    def last(self, k: int | None, room: int) -> PromptTokens:
        """vLLM's truncate_prompt_tokens: its last k tokens (-1: `room`'s worth, what the context
        leaves beside the answer's max_tokens), the spans of the earlier answers moved with them;
        None: as it is."""
        cut = 0 if k is None else max(0, len(self.ids) - (max(room, 1) if k == -1 else k))
        if not cut:
            return self
        spans = tuple((max(a - cut, 0), b - cut) for a, b in self.decoded if b > cut)
        return replace(self, ids=self.ids[cut:], decoded=spans)


def completion_tokens(model: ModelInfo, prompt: str | list[int], truncate: int | None, answer: int) -> PromptTokens:
    """A completion's prompt (text, or token ids) as token ids, its last `truncate` where given
    (-1: what leaves room for an `answer` of that many tokens).
    APIError (400) for ids not of the vocabulary or none; PromptTooLongError (413) for a text
    that cannot fit the context, untruncated."""
    if isinstance(prompt, str):
        if truncate is None:
            check_fits(model, prompt, "prompt")
        ids = encode(model, prompt, "prompt").ids
    else:
        ids = [int(t) for t in prompt]
        vocab = model.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return PromptTokens(ids).last(truncate, model.max_model_len - answer)


def check_fits(model: ModelInfo, text: str, param: str) -> None:
    """Refuse (413) a prompt that must be more tokens than the context, before tokenizing it
    (`Tokenizer.fewest_tokens`): a 2 MB prompt took 0.7-1.4 s of a core to count."""
    fewest = model.tokenizer.fewest_tokens(text)
    if fewest >= model.max_model_len:
        raise PromptTooLongError(
            f"the prompt has at least {fewest} tokens; this model's context is {model.max_model_len} tokens", param
        )


def encode(model: ModelInfo, text: str, param: str, answers: Sequence[tuple[int, int]] = ()) -> PromptTokens:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(f"{param} holds text that is not valid Unicode (a lone surrogate)", param) from None
    try:
        if not answers:
            return PromptTokens(model.tokenizer.encode(text))
        return PromptTokens(*model.tokenizer.encode_marking(text, answers))
    except Exception as e:
        log.warning("request %s: the tokenizer failed", REQUEST_ID.get(), exc_info=e)
        raise InvalidRequestError(f"the tokenizer could not encode {param}", param) from e
