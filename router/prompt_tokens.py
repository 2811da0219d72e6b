"""A prompt's text to token ids for the router: refused early where it cannot fit the context,
and tokenized with the spans of a chat's earlier answers."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import InvalidRequestError, PromptTooLongError
from router.backend import ModelInfo
from router.errors import REQUEST_ID

log = logging.getLogger("tandem.router")


@dataclass(frozen=True)
class PromptTokens:
    """A request's prompt as token ids, and the spans of its earlier answers (chat only)."""

    ids: list[int]
    decoded: tuple[tuple[int, int], ...] = ()  # SamplingParams.decoded
    decoded_as_prompt: bool = False  # SamplingParams.decoded_as_prompt


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
