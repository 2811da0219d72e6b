"""What a worker sends back across processes, per request: small, frozen, picklable values.

TokenOutput     one step's news for one request (decode and colocated streams, and the
                first token a prefill worker samples)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.outputs import RequestOutput, TokenLogprob


@dataclass(frozen=True)
class TokenOutput:
    """New tokens of one request. `num_output_tokens` counts every output token so far;
    `num_cached_tokens`: prompt tokens the engine found in its prefix cache (0 where unknown)."""

    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0  # speculation so far: draft tokens verified, and accepted
    num_accepted_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # with the first token, where asked (engine/prompt_logprobs.py)

    @classmethod
    def of(cls, o: RequestOutput) -> TokenOutput:
        return cls(
            tuple(o.new_token_ids),
            o.new_text,
            o.finished,
            o.finish_reason,
            o.num_prompt_tokens,
            o.num_output_tokens,
            tuple(o.logprobs),
            o.num_cached_tokens,
            o.num_draft_tokens,
            o.num_accepted_tokens,
            o.prompt_logprobs,
        )

    def shifted(self, prompt_tokens: int, earlier_outputs: int) -> TokenOutput:
        """As seen by the client of a request replayed after `earlier_outputs` tokens: the
        replay's prompt held those tokens, so they move from the prompt to the output count."""
        return replace(
            self, num_prompt_tokens=prompt_tokens, num_output_tokens=self.num_output_tokens + earlier_outputs
        )
