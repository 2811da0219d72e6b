"""What one sampled token does to its request: `Emitter.emit` appends it, then checks, in turn,
the request's stop tokens and end of sequence, its grammar (structured output: complete, or
broken), its stop strings (through its detokenizer; none before `min_tokens`), `max_tokens` and
the context; a prefill engine's request ends at its first token ("prefill_done"). It answers
with the text now safe to send (all that is held back, once the request ends), why the request
ends if it does, and the prompt's logprobs that go with a first token. The engine frees what
an ending request holds. The Emitter owns the requests' detokenizers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import TokenLogprob
from engine.request import Request

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Emitted:
    text: str
    reason: str | None  # "stop" | "length" | "prefill_done" | None: it goes on
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


class Emitter:
    def __init__(self, tokenizer: Tokenizer | None, eos_ids: frozenset[int], max_model_len: int) -> None:
        self._tokenizer = tokenizer
        self._eos_ids = eos_ids
        self._max_model_len = max_model_len
        self._detok: dict[str, IncrementalDetokenizer] = {}

    def open(self, req: Request) -> None:
        """Start `req`'s detokenizer (none without a tokenizer: token ids only)."""
        if self._tokenizer is not None:
            p = req.params
            self._detok[req.request_id] = IncrementalDetokenizer(
                self._tokenizer, req.prompt_token_ids, p.stop, p.skip_special_tokens, p.include_stop_str_in_output
            )

    def close(self, request_id: str) -> None:
        self._detok.pop(request_id, None)

    def open_ids(self) -> set[str]:
        """The requests it holds a detokenizer for (check_integrity: only live ones)."""
        return set(self._detok)

    def emit(self, req: Request, token: int) -> Emitted:
        req.token_ids.append(token)
        p = req.params
        detok = self._detok.get(req.request_id)
        text = ""
        reason: str | None = None
        if (
            token in p.stop_token_ids
            or (not p.ignore_eos and token in self._eos_ids)
            or (req.grammar is not None and not _follows(req, token))
        ):
            reason = "stop"
        elif detok is not None:
            text = detok.step([token], stops=req.num_output_tokens + p.output_offset >= p.min_tokens)
            if detok.stop_hit is not None:
                reason = "stop"
        if reason is None and (req.num_output_tokens >= p.max_tokens or req.num_tokens >= self._max_model_len):
            reason = "length"
        scored: tuple[TokenLogprob, ...] = ()
        if req.prompt_logprobs:  # computed with the first token, sent with it (engine/prompt_logprobs.py)
            scored, req.prompt_logprobs = req.scored_prompt(), []
        if reason is None and req.hands_off:
            reason = "prefill_done"
        if reason is not None:
            if detok is not None and detok.stop_hit is None:
                text += detok.flush()
            self._detok.pop(req.request_id, None)
        return Emitted(text, reason, scored)


def _follows(req: Request, token: int) -> bool:
    """Advance a guided request's matcher by `token`: False once its grammar is complete (the
    token ended it), or where the token breaks it, which its sampling mask rules out."""
    if not req.grammar.accept_token(token):
        log.warning("request %s: token %d does not follow its grammar; stopping it", req.request_id, token)
        return False
    return not req.grammar.is_terminated()
