"""Model-free drafters for speculative decoding (engine/speculation.py). No torch.

PromptLookup   per request: the longest tail of the request's own text (2-4 tokens) that occurred
               earlier in it, and what followed; for answers that copy their prompt.
OutputTree     per worker: the recent outputs of finished requests as continuation counts of each
               2-4 token context, bounded in tokens; a draft walks the most frequent continuation,
               each token's confidence its share of its context's count (SuffixDecoding's idea,
               Oliaro et al. 2025, on an n-gram index rather than a suffix tree); for traffic
               that repeats itself across requests, as agents do.
SuffixDrafter  per request: both, the more confident first.

arctic-inference's SuffixDecodingCache was the first choice; its PyPI release is a source
distribution whose build pulls torch>=2.10 (a CUDA build, several GB) into an isolated build
environment, plus cmake and a pinned protobuf 5.29.6, so it does not install here.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Draft:
    """Proposed next tokens, each with a confidence in (0, 1]: the chance it is accepted once
    every token before it was (so a prefix's chance is the product of its confidences)."""

    token_ids: tuple[int, ...]
    confidence: tuple[float, ...]


NO_DRAFT = Draft((), ())

# Prompt lookup's confidences, as measured: `tandem bench spec`'s greedy answers (int8, 4 workloads x
# 4 prompts, 128 tokens) replayed through it, every proposal scored against what came. The first
# token was accepted 0.42-0.53 of the time after a 2-token match, 0.45-0.64 after 3, 0.64-0.92 after
# 4; each next one, once the one before was, 0.6-0.97 (mostly 0.8-0.95): a copy, once it starts,
# goes on. Before, every token had its match's quality (0.6 / 0.8 / 1.0), compounding, so a
# 2-token match's fourth token counted as 0.13 where it is accepted about half the time.
MATCH_CONFIDENCE = (0.0, 0.0, 0.5, 0.55, 0.8)  # by match length; 4 or more the last
COPY_CONFIDENCE = 0.85


class PromptLookup:
    """One request's prompt-lookup drafter: an index from each n-gram (`min_ngram`..`max_ngram`
    tokens) of its text to the position after its latest occurrence, kept up to date as tokens
    are appended (`update`), so a proposal costs a few dict lookups however long the text."""

    def __init__(self, max_draft: int = 4, min_ngram: int = 2, max_ngram: int = 4) -> None:
        self.max_draft = max_draft
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._follows: dict[tuple[int, ...], int] = {}

    def update(self, tokens: Sequence[int]) -> None:
        """Catch up with the request's tokens (prompt + output so far)."""
        for p in range(len(self.tokens), len(tokens)):
            self.tokens.append(tokens[p])
            for n in range(self.min_ngram, min(self.max_ngram, p) + 1):
                self._follows[tuple(self.tokens[p - n : p])] = p

    def propose(self) -> Draft:
        """The tokens that followed the latest earlier occurrence of the longest matching tail:
        the first as likely as a match of that length is (MATCH_CONFIDENCE), each next one
        COPY_CONFIDENCE once the one before was accepted."""
        t = self.tokens
        for n in range(min(self.max_ngram, len(t)), self.min_ngram - 1, -1):
            at = self._follows.get(tuple(t[len(t) - n :]))
            if at is not None:
                follow = tuple(t[at : at + self.max_draft])
                first = MATCH_CONFIDENCE[min(n, len(MATCH_CONFIDENCE) - 1)]
                return Draft(follow, (first,) + (COPY_CONFIDENCE,) * (len(follow) - 1))
        return NO_DRAFT


class OutputTree:
    """Worker-global continuation counts over the last `capacity` output tokens (see the module).
    A continuation seen once drafts (`min_count` 1): the verify policy weighs it by its share and
    the request's acceptance. Against 2, alternated, `tandem bench spec` single stream: summarize
    1.66 / 1.84x -> 1.87 / 2.00x, agentic 1.31 / 1.34x -> 1.48 / 1.46x, chat 1.04 / 1.04x ->
    1.33 / 1.08x, code edit 1.74 / 1.57x -> 1.73 / 1.85x; batch 16 drafts nothing either way."""

    def __init__(self, capacity: int = 200_000, max_draft: int = 4, min_ngram: int = 2, max_ngram: int = 4,
                 min_count: int = 1) -> None:  # fmt: skip
        self.capacity = capacity
        self.max_draft = max_draft
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.min_count = min_count
        self._next: dict[tuple[int, ...], Counter[int]] = {}
        self._total: Counter[tuple[int, ...]] = Counter()
        self._log: deque[tuple[tuple[int, ...], int]] = deque()
        self.tokens = 0

    def clear(self) -> None:
        """Forget every output (a benchmark starts each round from an empty tree)."""
        self._next.clear()
        self._total.clear()
        self._log.clear()
        self.tokens = 0

    def add(self, context: Sequence[int], output: Sequence[int]) -> None:
        """A finished request's `output`, after the last tokens of its prompt (`context`)."""
        t = list(context[-self.max_ngram :]) + list(output)
        first = len(t) - len(output)
        for p in range(max(first, self.min_ngram), len(t)):
            for n in range(self.min_ngram, min(self.max_ngram, p) + 1):
                key = tuple(t[p - n : p])
                self._next.setdefault(key, Counter())[t[p]] += 1
                self._total[key] += 1
                self._log.append((key, t[p]))
        self.tokens += len(output)
        while self.tokens > self.capacity and self._log:
            self._forget()

    def _forget(self) -> None:
        """Drop the oldest output token's entries (one entry per context length)."""
        for _ in range(self.max_ngram - self.min_ngram + 1):
            if not self._log:
                break
            key, tok = self._log.popleft()
            nxt = self._next[key]
            nxt[tok] -= 1
            self._total[key] -= 1
            if nxt[tok] == 0:
                del nxt[tok]
            if not nxt:
                del self._next[key], self._total[key]
        self.tokens -= 1

    def propose(self, tail: Sequence[int]) -> Draft:
        """Walk the most frequent continuation of `tail`, while one was seen `min_count` times."""
        ctx = list(tail[-self.max_ngram :])
        toks: list[int] = []
        conf: list[float] = []
        while len(toks) < self.max_draft:
            for n in range(min(self.max_ngram, len(ctx)), self.min_ngram - 1, -1):
                key = tuple(ctx[len(ctx) - n :])
                nxt = self._next.get(key)
                if nxt is not None:
                    tok, count = nxt.most_common(1)[0]
                    break
            else:
                break
            if count < self.min_count:
                break
            toks.append(tok)
            conf.append(count / self._total[key])
            ctx.append(tok)
        return Draft(tuple(toks), tuple(conf))

    def check_integrity(self) -> None:
        """Raise AssertionError unless the counts, their totals and the eviction log agree."""
        logged: Counter[tuple[tuple[int, ...], int]] = Counter(self._log)
        for key, nxt in self._next.items():
            assert nxt and all(c > 0 for c in nxt.values()), f"empty or non-positive counts under {key}"
            assert self._total[key] == sum(nxt.values()), f"total of {key} is off"
            for tok, c in nxt.items():
                assert logged[(key, tok)] == c, f"{key} -> {tok}: {c} counted, {logged[(key, tok)]} logged"
        assert sum(logged.values()) == sum(self._total.values()), "the log holds entries no count has"
        assert self.tokens <= self.capacity, f"{self.tokens} tokens kept, capacity {self.capacity}"


class SuffixDrafter:
    """One request's drafter over its own text and the worker's OutputTree."""

    def __init__(self, tree: OutputTree, max_draft: int = 4) -> None:
        self.tree = tree
        self.own = PromptLookup(max_draft)

    def update(self, tokens: Sequence[int]) -> None:
        self.own.update(tokens)

    def propose(self) -> Draft:
        mine = self.own.propose()
        shared = self.tree.propose(self.own.tokens)
        if not shared.token_ids or (mine.token_ids and mine.confidence[0] >= shared.confidence[0]):
            return mine
        return shared
