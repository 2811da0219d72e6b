"""Speculative decoding: who drafts, how much of a draft is worth verifying, and what is accepted.

    step k:   a running request's last token t, plus a draft d1..dk from its own text
    model:    one chunk [t, d1, .., dk] in the step's flat batch: logits at all k+1 positions
    sampler:  position i sampled with the request's own stream for output index n+i, the same
              (seed, index) draw as without speculation
    accept:   d1.. while each equals the sample before it; the first mismatch's sample is emitted
              there; all k accepted also emits the sample after dk (a bonus token)

So greedy and seeded sampling give, token for token, what speculation off gives. KV of rejected
positions is rolled back: `num_computed_tokens` covers verified tokens only, the prefix cache
hashes only those, and blocks past them are freed.

Drafter (model-free; SmolLM2 ships no draft model): prompt lookup. The longest suffix of the
request's tokens (up to `max_ngram`) that occurred earlier is matched; the tokens after that
occurrence are the draft. A draft token's confidence is the match's quality (a 4-gram 1.0, a
3-gram 0.8, a 2-gram 0.6) times the request's own acceptance so far (a moving average): a
request that copies its prompt keeps drafting, open chat soon stops.

Draft length by load (`verify_len`): at a small batch the step is memory-bound, and verifying a
few more tokens costs almost nothing; at a large one it is compute-bound, and every rejected
token costs real work. The prefix of the draft whose cumulative confidence clears a threshold
that rises with the step's running requests is verified; the rest is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from engine.kv_cache import KVCacheManager
from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampler import TokenLogprob
from engine.scheduler import ScheduledChunk


@dataclass(frozen=True)
class Draft:
    """Proposed next tokens, each with a confidence in (0, 1]."""

    token_ids: tuple[int, ...]
    confidence: tuple[float, ...]


NO_DRAFT = Draft((), ())
PRIOR_RATE = 0.7  # a request's acceptance before its first verified draft
RATE_WEIGHT = 0.3  # of the latest draft in a request's moving acceptance


class PromptLookup:
    """One request's prompt-lookup drafter: an index from each n-gram (`min_ngram`..`max_ngram`
    tokens) of its text to the position after its latest occurrence, kept up to date as tokens
    are appended (`update`), so a proposal costs a few dict lookups however long the text."""

    def __init__(self, max_draft: int = 4, min_ngram: int = 2, max_ngram: int = 4) -> None:
        self.max_draft = max_draft
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self._tokens: list[int] = []
        self._follows: dict[tuple[int, ...], int] = {}

    def update(self, tokens: Sequence[int]) -> None:
        """Catch up with the request's tokens (prompt + output so far)."""
        for p in range(len(self._tokens), len(tokens)):
            self._tokens.append(tokens[p])
            for n in range(self.min_ngram, min(self.max_ngram, p) + 1):
                self._follows[tuple(self._tokens[p - n : p])] = p

    def propose(self) -> Draft:
        """The tokens that followed the latest earlier occurrence of the longest matching tail."""
        t = self._tokens
        for n in range(min(self.max_ngram, len(t)), self.min_ngram - 1, -1):
            at = self._follows.get(tuple(t[len(t) - n :]))
            if at is not None:
                follow = tuple(t[at : at + self.max_draft])
                quality = 1.0 if n >= 4 else 0.8 if n == 3 else 0.6  # a longer match, a likelier copy
                return Draft(follow, (quality,) * len(follow))
        return NO_DRAFT


def verify_len(draft: Draft, running: int, base: float = 0.2, per_request: float = 0.045) -> int:
    """How many leading draft tokens to verify in a step that runs `running` requests: the
    longest prefix whose cumulative confidence (the product) is at least `base + per_request
    * (running - 1)`, capped at 0.95 so that a full batch still verifies sure drafts."""
    threshold = min(0.95, base + per_request * max(0, running - 1))
    p = 1.0
    for i, c in enumerate(draft.confidence):
        p *= c
        if p < threshold:
            return i
    return len(draft.token_ids)


def accepted(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """Leading draft tokens the samples confirm: d_i is accepted while it equals sample i
    (`sampled` has one more entry than `draft`: the sample after the last draft token)."""
    n = 0
    while n < len(draft) and draft[n] == sampled[n]:
        n += 1
    return n


AppendToken = Callable[[Request, int, "TokenLogprob | None"], RequestOutput]


class Speculator:
    """An engine's speculation: drafts for its running requests before each step, and turns a
    verified chunk's samples into one output. `drafts`: drafts verified so far; `drafted` /
    `accepted`: their tokens, and those accepted; `per_position[i]`: accepted at position i."""

    def __init__(self, kv: KVCacheManager, max_draft: int, max_model_len: int) -> None:
        self.kv = kv
        self.max_draft = max_draft
        self.max_model_len = max_model_len
        self._drafters: dict[str, PromptLookup] = {}
        self._rate: dict[str, float] = {}  # each request's draft tokens accepted, a moving average
        self.drafts = 0
        self.drafted = 0
        self.accepted = 0
        self.per_position = [0] * max_draft

    def draft(self, running: Sequence[Request]) -> None:
        """Set `draft` on each running request that is decoding (one token without KV)."""
        live = {r.request_id for r in running}
        for rid in [r for r in self._drafters if r not in live]:
            del self._drafters[rid]
            self._rate.pop(rid, None)
        for req in running:
            if req.num_tokens - req.num_computed_tokens != 1 or not req.params.speculate:
                continue
            d = self._drafters.setdefault(req.request_id, PromptLookup(self.max_draft))
            d.update(req.token_ids)
            # the last draft token's sample is emitted too: k drafts can emit k + 1 tokens
            room = min(req.params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
            draft = d.propose()
            rate = self._rate.get(req.request_id, PRIOR_RATE)  # a token's confidence: match x history
            draft = Draft(draft.token_ids, tuple(c * rate for c in draft.confidence))
            req.draft = draft.token_ids[: max(0, min(room, verify_len(draft, len(running))))]

    def accept(
        self, c: ScheduledChunk, samples: Sequence[int], logprobs: Sequence[TokenLogprob | None], append: AppendToken
    ) -> RequestOutput:
        """Emit the samples the draft earns (`append` checks stops after each), roll the KV
        back to the verified tokens, and merge what was emitted into one output."""
        req, n = c.request, accepted(c.draft, samples)
        self.drafts += 1
        self.drafted += len(c.draft)
        rid = req.request_id
        self._rate[rid] = (1 - RATE_WEIGHT) * self._rate.get(rid, PRIOR_RATE) + RATE_WEIGHT * n / len(c.draft)
        self.accepted += n
        for i in range(n):
            self.per_position[i] += 1
        outs: list[RequestOutput] = []
        for tok, lp in zip(samples[: n + 1], logprobs[: n + 1], strict=True):
            outs.append(append(req, tok, lp))
            if outs[-1].finished:
                break
        if not outs[-1].finished:  # the last emitted token has no KV yet, as after any decode
            req.num_computed_tokens = c.start + 1 + n
            self.kv.cache_full_blocks(req.request_id, req.token_ids, req.num_computed_tokens)
            self.kv.trim(req.request_id, req.num_tokens)
        last = outs[-1]
        return replace(
            last,
            new_token_ids=[t for o in outs for t in o.new_token_ids],
            new_text="".join(o.new_text for o in outs),
            logprobs=[lp for o in outs for lp in o.logprobs],
        )

    def stats(self) -> dict[str, object]:
        """Counters with vLLM's names, for the worker's stats and the router's metrics."""
        return {"spec_decode_num_drafts": self.drafts, "spec_decode_num_draft_tokens": self.drafted,
                "spec_decode_num_accepted_tokens": self.accepted,
                "spec_decode_num_accepted_tokens_per_pos": list(self.per_position)}  # fmt: skip
