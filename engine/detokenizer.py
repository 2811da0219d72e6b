"""Streaming token ids -> text for one request: whole characters only, stop strings never leaked."""

from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import Tokenizer

# Prompt tokens decoded ahead of the output, so a decoder that strips a leading space sees real context.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's output ids into text as they arrive, vLLM-style.

    Only a short window of trailing ids is decoded per step (prefix/read offsets), so a step costs
    O(1) in the output length. Text is held back while the window ends in an incomplete UTF-8
    character, and while its end could be the start of a stop string. Once the output contains a
    stop string, the text is cut just before it (after it, `include_stop`), `stop_hit` is set and
    nothing more is emitted.

    Invariant: the concatenation of every `step()` return and `flush()` equals `text`; without a
    stop hit that is `tokenizer.decode(output_ids, skip_special_tokens)`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._include_stop = include_stop  # vLLM's include_stop_str_in_output: cut just after it
        self._stops = tuple(s for s in stop if s)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        # Window of ids: [0, read_offset) is already emitted (the context), [read_offset, end) is not yet.
        self._ids = list(prompt_ids[max(0, len(prompt_ids) - _PROMPT_CONTEXT_TOKENS) :])
        self._read_offset = len(self._ids)
        self._chunks: list[str] = []
        self._held = ""
        self.stop_hit: str | None = None

    @property
    def text(self) -> str:
        """All output text decoded so far (emitted plus held back), cut before the stop string once hit."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return (self._chunks[0] if self._chunks else "") + self._held

    def step(self, new_token_ids: Sequence[int], stops: bool = True) -> str:
        """Add generated ids; return the text that is now safe to send (possibly empty). With
        `stops` False (an answer short of its `min_tokens`), no stop string ends it: the text is
        sent whole, and a later stop string counts only if it lies wholly in text decoded after."""
        if self.stop_hit is not None:
            return ""
        self._ids.extend(new_token_ids)
        delta = self._decode_unread(final=False)
        return self._emit(delta, final=not stops, stops=stops) if delta else ""

    def flush(self) -> str:
        """End of generation: return everything still held back ('' once a stop string was hit)."""
        if self.stop_hit is not None:
            return ""
        return self._emit(self._decode_unread(final=True), final=True)

    def _decode_unread(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[: self._read_offset])
        full_text = self._decode(self._ids)
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR)):
            return ""
        # The unread ids become the next step's context; older ids are no longer needed.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _emit(self, delta: str, final: bool, stops: bool = True) -> str:
        # A stop string cannot start in text already sent: that text never ended in a stop-string prefix.
        pending = self._held + delta
        hit = self._find_stop(pending) if stops else None
        if hit is not None:
            pending, self.stop_hit = pending[: hit[0] + (len(hit[1]) if self._include_stop else 0)], hit[1]
            keep = 0
        else:
            keep = 0 if final else self._stop_prefix_len(pending)
        out, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self._chunks.append(out)
        return out

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        found = [(i, stop) for stop in self._stops if (i := text.find(stop)) >= 0]
        return min(found, key=lambda f: f[0]) if found else None

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for k in range(min(len(text), self._max_stop_len - 1), 0, -1):
            suffix = text[-k:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return k
        return 0
