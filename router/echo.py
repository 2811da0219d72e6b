"""`echo` on /v1/completions (OpenAI's legacy API; lm-evaluation-harness scores a prompt this way):
the choice's text is the prompt's, then the completion's, and with `logprobs` the prompt's tokens
come first in the logprobs too: the first with none (null), each other with its logprob after
the tokens before it and the top N there (the engine's prompt logprobs, engine/prompt_logprobs.py,
sent with the first token). `max_tokens: 0` with echo asks for the prompt alone: the engine runs
to one token, which is neither sent nor counted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cluster.outputs import StreamOutput
from engine.outputs import TokenLogprob

UNSCORED = math.nan  # the logprob of a prompt's first token, which nothing predicts: null to the client


@dataclass(frozen=True)
class Echo:
    """What a run of an echoing request puts in front of its outputs."""

    text: str  # the prompt as the client sent it (decoded, where it sent token ids)
    prompt_ids: tuple[int, ...]
    logprobs: int | None  # the top N a token, where asked
    answer: bool = True  # False: `max_tokens: 0`, the prompt alone

    @classmethod
    def of(cls, text: str, prompt_ids: Sequence[int], logprobs: int | None, max_tokens: int | None) -> Echo:
        return cls(text, tuple(prompt_ids), logprobs, max_tokens != 0)

    def output(self, out: StreamOutput, first: bool) -> StreamOutput:
        """`out` as the client sees it: the first with the prompt in front; without an answer,
        emptied of its tokens. (Its prompt logprobs stay, for a `prompt_logprobs` that asked more.)"""
        lead: tuple[TokenLogprob, ...] = ()
        if first and self.logprobs is not None:
            top = self.logprobs
            scored = (replace(e, top=e.top[:top]) for e in out.prompt_logprobs)
            lead = (TokenLogprob(self.prompt_ids[0], UNSCORED, ()), *scored)
        if not self.answer:
            return replace(out, token_ids=(), text=self.text if first else "", logprobs=lead)
        if not first:
            return out
        return replace(out, text=self.text + out.text, logprobs=lead + out.logprobs)
