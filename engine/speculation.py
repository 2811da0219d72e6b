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

Drafters (engine/drafters.py, model-free: SmolLM2 ships no draft model): "ngram", prompt lookup
in the request's own text; "suffix", that and the worker's recent outputs. A draft token's
confidence is the drafter's: the chance it is accepted once the tokens before it were. The first
token's is scaled by the request's trust (`updated_trust`): how its first draft tokens fared
against what the drafter promised, a moving average over every draft it proposed, verified or
not (one not verified is scored against the token that came instead). So a request that copies
its prompt keeps drafting, open chat drafts less, and a request that stopped copying for a while
starts again when it copies again (scored only on verified drafts, trust that fell below a
row's cost had never recovered: a summarize answer that paraphrased one sentence drafted nothing
after it).

Draft length by load (`verify_len`): at a small batch the step is memory-bound, and verifying a
few more tokens costs almost nothing; at a large one it is compute-bound, and every rejected
token costs real work. A draft token is verified while the chance that it and every draft
token before it are accepted (the cumulative confidence) clears the marginal cost of one
more row in the step, in tokens, which rises with the step's rows. Rows include the drafts
already granted this step: requests draft in turn, and each one's tokens make the next
one's rows dearer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from engine.config import EngineConfig
from engine.drafters import Draft, OutputTree, PromptLookup, SuffixDrafter
from engine.grammar import grammatical
from engine.kv_cache import KVCacheManager
from engine.outputs import RequestOutput, TokenLogprob
from engine.request import Request
from engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)

TRUST_WEIGHT = 0.3  # of the latest draft in a request's trust (starts at 1: the drafter's word)
MAX_TRUST = 2.0
# A decode step of B rows takes about a + b B (a: what it costs whatever its rows, the weights'
# reads; b: a row's attention and matmul work), so one more row costs b / T(B) of the step, which
# yields B tokens: B / (B + STEP_KNEE) of a token, STEP_KNEE = a / b. Fitted to the step times on
# record (README, "Speculative decoding"): the fused step 5.2 (a Zen 5: 3.35 ms at 1 row, 11.65
# at 17), 3.8 (the same CPU, an earlier build), 5.6 (a Zen 4), 7.4 (an AVX-512 Xeon); the torch
# ops 5.6 (22.4 ms at 1 row, 78.3 at 17). Until a later session this was a line, 0.11 + 0.045 a
# row (0.2 + for the torch ops), under the measured cost from 3 rows on (0.43 at 8 rows, where
# that Zen 5's steps say 0.5-0.75): 4 streams of summarize ran at 0.90-0.97x of speculation off
# with it, 1.05-1.09x with this.
STEP_KNEE = 5.0
# No request looks for a draft in a step whose next row would cost this many tokens or more:
# there even a sure first token barely pays, and a look costs 13-19 us a request (a 16-row
# step: 2-3% of it). From 10 rows on.
DRAFT_BELOW_COST = 0.65


def row_cost(rows: int, knee: float = STEP_KNEE) -> float:
    """The marginal cost of one more row in a step of `rows` rows, in tokens: what a row's
    acceptance must beat to pay (see STEP_KNEE); capped at 0.95 so that a full step still
    verifies sure drafts."""
    return min(0.95, rows / (rows + knee))


def verify_len(draft: Draft, rows: int) -> int:
    """How many leading draft tokens to verify in a step that already has `rows` rows: draft
    token i (its row the step's rows + i) is verified while the cumulative confidence of
    tokens 0..i is at least `row_cost` of the rows before it."""
    p = 1.0
    for i, c in enumerate(draft.confidence):
        p *= c
        if p < row_cost(rows + i):
            return i
    return len(draft.token_ids)


def updated_trust(trust: float, confidence: float, hit: bool) -> float:
    """A request's trust after a draft whose first token the drafter gave `confidence` was
    accepted (`hit`) or not: a moving average of hit / confidence, so 1 while the drafter is
    right about it, within [0, MAX_TRUST]."""
    return min(MAX_TRUST, (1 - TRUST_WEIGHT) * trust + TRUST_WEIGHT * hit / max(confidence, 1e-3))


def trusted(draft: Draft, trust: float) -> Draft:
    """`draft` with its first token's confidence scaled by the request's trust (at most 1)."""
    if not draft.token_ids:
        return draft
    return Draft(draft.token_ids, (min(1.0, draft.confidence[0] * trust),) + draft.confidence[1:])


def accepted(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """Leading draft tokens the samples confirm: d_i is accepted while it equals sample i
    (`sampled` has one more entry than `draft`: the sample after the last draft token)."""
    n = 0
    while n < len(draft) and draft[n] == sampled[n]:
        n += 1
    return n


AppendToken = Callable[[Request, int, "TokenLogprob | None"], RequestOutput]
Drafter = PromptLookup | SuffixDrafter


@dataclass
class _Tracked:
    """One decoding request's speculation."""

    request: Request
    drafter: Drafter
    failed: bool = False  # its drafter raised: no more drafts for it
    trust: float = 1.0  # updated_trust's
    # its last draft not verified: (the index its first token would have had, that token, the
    # drafter's confidence in it), scored at the next draft against the token that came there
    unverified: tuple[int, int, float] | None = None
    first_confidence: float = 1.0  # the drafter's, in the first token of the draft being verified


class Speculator:
    """An engine's speculation: drafts for its running requests before each step, and turns a
    verified chunk's samples into one output. `drafts`: drafts verified so far; `drafted` /
    `accepted`: their tokens, and those accepted; `per_position[i]`: accepted at position i."""

    def __init__(
        self,
        kv: KVCacheManager,
        max_draft: int,
        max_model_len: int,
        kind: str = "ngram",
        new_drafter: Callable[[], Drafter] | None = None,
    ) -> None:
        """`new_drafter`: a request's drafter (default: `kind`'s)."""
        self.kv = kv
        self.max_draft = max_draft
        self.max_model_len = max_model_len
        self.tree = OutputTree(max_draft=max_draft) if kind == "suffix" else None
        self.new_drafter = new_drafter or self._new_drafter
        self._tracked: dict[str, _Tracked] = {}
        self.drafts = 0
        self.drafted = 0
        self.accepted = 0
        self.per_position = [0] * max_draft

    def draft(self, running: Sequence[Request]) -> None:
        """Set `draft` on each running request that is decoding (one output token without KV). A
        request whose drafter fails runs on without speculation: its answer is the same."""
        live = {id(r) for r in running}  # the objects: an id may come back as a new request
        rows = len(running)  # a row each, before drafts
        for rid in [rid for rid, t in self._tracked.items() if id(t.request) not in live]:
            self._forget(rid)
        for req in running:
            if req.num_tokens - req.num_computed_tokens != 1 or not req.params.speculate or not req.num_output_tokens:
                continue  # not decoding: a prompt's last token is prefilled (ScheduledChunk.is_decode)
            t = self._tracked.get(req.request_id)
            if t is None:
                t = self._tracked[req.request_id] = _Tracked(req, self.new_drafter())
            if t.failed:
                continue
            try:
                rows += self._draft(req, t, rows)
            except Exception:
                log.exception("drafting for request %s failed; it runs on without speculation", req.request_id)
                t.failed, req.draft = True, ()

    def _draft(self, req: Request, t: _Tracked, rows: int) -> int:
        """Set `req.draft`; returns its length."""
        t.drafter.update(req.token_ids)
        if t.unverified is not None and t.unverified[0] < req.num_tokens:
            at, token, confidence = t.unverified
            t.trust = updated_trust(t.trust, confidence, req.token_ids[at] == token)
        t.unverified, req.draft = None, ()
        if row_cost(rows) >= DRAFT_BELOW_COST:
            return 0
        # the last draft token's sample is emitted too: k drafts can emit k + 1 tokens
        room = min(req.params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
        draft = t.drafter.propose()
        if not draft.token_ids:
            return 0
        req.draft = draft.token_ids[: max(0, min(room, verify_len(trusted(draft, t.trust), rows)))]
        if req.grammar is not None:  # structured output: what its grammar allows, no more
            req.draft = grammatical(req.grammar, req.draft)
        if req.draft:
            t.first_confidence = draft.confidence[0]
        else:
            t.unverified = (req.num_tokens, draft.token_ids[0], draft.confidence[0])
        return len(req.draft)

    def reset(self) -> None:
        """Forget every request tracked and every output the tree holds, so nothing run before
        drafts anything after (a benchmark's round). A finished request joins the tree only at
        the next `draft`, so clearing the tree alone would let the last ones in. Call it with
        nothing running."""
        self._tracked.clear()
        if self.tree is not None:
            self.tree.clear()

    def _forget(self, request_id: str) -> None:
        """A request left the running set: finished (its answer joins the tree) or preempted."""
        done = self._tracked.pop(request_id).request
        if self.tree is not None and done.finish_reason in ("stop", "length"):
            self.tree.add(done.prompt_token_ids, done.output_token_ids)

    def _new_drafter(self) -> Drafter:
        return PromptLookup(self.max_draft) if self.tree is None else SuffixDrafter(self.tree, self.max_draft)

    def accept(
        self, c: ScheduledChunk, samples: Sequence[int], logprobs: Sequence[TokenLogprob | None], append: AppendToken
    ) -> RequestOutput:
        """Emit the samples the draft earns (`append` checks stops after each), roll the KV
        back to the verified tokens, and merge what was emitted into one output."""
        req, n = c.request, accepted(c.draft, samples)
        self.drafts += 1
        self.drafted += len(c.draft)
        req.num_draft_tokens += len(c.draft)
        req.num_accepted_tokens += n
        t = self._tracked.get(req.request_id)
        if t is not None:
            t.trust = updated_trust(t.trust, t.first_confidence, n > 0)
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
            self.kv.cache_full_blocks(req.request_id, req.cache_keys(), req.num_computed_tokens)
            self.kv.trim(req.request_id, req.num_tokens)
        last = outs[-1]
        return replace(
            last,
            new_token_ids=[t for o in outs for t in o.new_token_ids],
            new_text="".join(o.new_text for o in outs),
            logprobs=[lp for o in outs for lp in o.logprobs],
            num_draft_tokens=req.num_draft_tokens,
            num_accepted_tokens=req.num_accepted_tokens,
        )

    def stats(self) -> dict[str, object]:
        """Counters with vLLM's names, for the worker's stats and the router's metrics."""
        return {"spec_decode_num_drafts": self.drafts, "spec_decode_num_draft_tokens": self.drafted,
                "spec_decode_num_accepted_tokens": self.accepted,
                "spec_decode_num_accepted_tokens_per_pos": list(self.per_position)}  # fmt: skip


def speculator_for(config: EngineConfig, kv: KVCacheManager, max_model_len: int) -> Speculator | None:
    """An engine's speculator as `config` asks for it: none when speculation is off or the engine
    prefills only (it never decodes)."""
    if not config.speculative or config.role == "prefill":
        return None
    return Speculator(kv, config.num_speculative_tokens, max_model_len, config.speculative)
