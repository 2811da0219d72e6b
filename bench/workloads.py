"""What a load generator sends: named synthetic mixes with seeded length distributions, or a JSONL file.

Lengths are in content tokens. The text is drawn from 100 English words that are one token
each in the bundled model's BPE vocabulary (and in most GPT-2 style ones), so n words ~ n tokens;
the chat template adds a few more, and reports count what the server's `usage` says.

    multiturn: a conversation's turn k is sent after turn k-1 has finished, and repeats its history
    with the answers the server gave (as a chat client does; bench.loadgen fills them in):

    turn 0   [system][user 0]
    turn 1   [system][user 0][assistant 0][user 1]          <- turn 0's prompt is a prefix
    turn 2   [system][user 0][assistant 0][user 1][assistant 1][user 2]
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health "
    "person art war history party result change morning reason research girl guy moment air teacher force education"
)
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class LengthDist:
    """Log-normal token counts: `median` x exp(N(0, sigma)), rounded and clipped to [lo, hi]."""

    median: float
    sigma: float
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.median <= self.hi or self.sigma < 0:
            raise ValueError(f"need 1 <= lo <= median <= hi and sigma >= 0: {self}")

    def sample(self, rng: random.Random) -> int:
        return min(max(round(self.median * math.exp(rng.gauss(0.0, self.sigma))), self.lo), self.hi)

    def scaled(self, f: float) -> LengthDist:
        lo = max(1, round(self.lo * f))
        hi = max(lo, round(self.hi * f))
        return LengthDist(min(max(self.median * f, lo), hi), self.sigma, lo, hi)


@dataclass(frozen=True)
class Mix:
    """A named workload shape. `input` is the new user text per request (per turn in a
    conversation); `turns` (lo, hi) > 1 makes conversations; `system` tokens of system prompt,
    one per workload, shared by every request.

    Every request carries a class: the name of the shape it was drawn from. `mixed_in` puts
    other single-turn shapes (share, Mix) into a single-turn mix: of n requests, share x n
    (rounded) have that mix's shape, in seeded random order, and the rest have this one's,
    whose class is `cls` (default: the mix's name)."""

    name: str
    description: str
    input: LengthDist
    output: LengthDist
    turns: tuple[int, int] = (1, 1)
    system: int = 0
    cls: str = ""
    mixed_in: tuple[tuple[float, Mix], ...] = ()

    def __post_init__(self) -> None:
        if not self.mixed_in:
            return
        shares = [s for s, _ in self.mixed_in]
        if min(shares) <= 0 or sum(shares) >= 1:
            raise ValueError(f"{self.name}: mixed-in shares must be > 0 and sum to < 1, got {shares}")
        if self.turns != (1, 1) or any(m.turns != (1, 1) or m.system or m.mixed_in for _, m in self.mixed_in):
            raise ValueError(f"{self.name}: only single-turn mixes mix, with no system prompt of their own")

    @property
    def classes(self) -> tuple[tuple[float, Mix], ...]:
        """(share, shape) of each request class, this mix's own first; each shape is a plain
        mix named after its class (what to send to measure that class alone)."""
        own = replace(self, name=self.cls or self.name, cls="", mixed_in=())
        return ((1.0 - sum(s for s, _ in self.mixed_in), own), *self.mixed_in)

    def scaled(self, input: float = 1.0, output: float = 1.0) -> Mix:
        """The same shape with lengths times `input` / `output` (to fit a slower machine)."""
        return replace(
            self,
            input=self.input.scaled(input),
            output=self.output.scaled(output),
            system=round(self.system * input),
            mixed_in=tuple((s, m.scaled(input, output)) for s, m in self.mixed_in),
        )


MIXES: dict[str, Mix] = {
    m.name: m
    for m in (
        Mix("chat", "ShareGPT-like: medium, widely spread prompts and answers",
            LengthDist(180, 0.9, 8, 1536), LengthDist(160, 0.8, 8, 768)),
        Mix("summarize", "long documents in, short summaries out (prefill-heavy)",
            LengthDist(1200, 0.35, 512, 3000), LengthDist(64, 0.4, 16, 160)),
        Mix("code", "medium code context in, short completion out",
            LengthDist(400, 0.5, 96, 1200), LengthDist(40, 0.5, 8, 128)),
        Mix("multiturn", "conversations of 3-6 turns, each repeating its history (shared, growing prefixes)",
            LengthDist(80, 0.6, 16, 256), LengthDist(80, 0.5, 16, 256), turns=(3, 6), system=96),
        Mix("interference", "1 request in 4 has a 2K-token prompt (short answer), the rest are short chats with "
            "128-token answers: a long prefill stalls the chats' decodes when they share an engine",
            LengthDist(64, 0.4, 24, 160), LengthDist(128, 0.0, 128, 128), cls="chat",
            mixed_in=((0.25, Mix("long-prompt", "a 2K-token document, a short answer",
                                 LengthDist(2048, 0.03, 1920, 2176), LengthDist(24, 0.25, 16, 32))),)),
    )
}  # fmt: skip


@dataclass(frozen=True)
class WorkItem:
    """One request. Chat when `messages` is set, else a plain completion of `prompt`.
    `conv` >= 0: turn `turn` of conversation `conv`, sent only after turn - 1 has finished."""

    max_tokens: int
    messages: tuple[tuple[str, str], ...] = ()
    prompt: str | None = None
    conv: int = -1
    turn: int = 0
    new_tokens: int = 0  # the nominal length of this request's new input text
    cls: str = ""  # its request class (Mix.classes)

    @property
    def chat(self) -> bool:
        return self.prompt is None

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]

    def answered(self, answers: Sequence[str]) -> WorkItem:
        """This turn with its history's assistant messages replaced by `answers` (the server's
        answers to the earlier turns, in order), as a client sends them; an empty answer (a turn
        that failed) keeps the stand-in text."""
        it = iter(answers)
        msgs = tuple((r, (next(it, "") or c) if r == "assistant" else c) for r, c in self.messages)
        return replace(self, messages=msgs)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_items(mix: Mix, n: int, seed: int = 0, salt: int = 0, active: int = 8) -> list[WorkItem]:
    """`n` requests of `mix`. Lengths depend on `seed` only, text on (`seed`, `salt`): two salts
    give the same shapes with nothing in common (no prefix of one is cached for the other).
    Conversations run `active` at a time: each of `active` users starts a new one when theirs ends,
    and the users' requests interleave."""
    lengths = random.Random(seed)
    text = random.Random(f"tandem-bench-{seed}-{salt}")
    system = (("system", words(text, mix.system)),) if mix.system else ()
    if mix.turns == (1, 1):
        out = []
        for shape in _class_order(mix, n, lengths):
            k, m = shape.input.sample(lengths), shape.output.sample(lengths)
            out.append(WorkItem(m, (*system, ("user", words(text, k))), new_tokens=k, cls=shape.name))
        return out
    convs: list[list[WorkItem]] = []
    total = 0
    while total < n:
        conv, history = [], list(system)
        for turn in range(lengths.randint(*mix.turns)):
            k, m = mix.input.sample(lengths), mix.output.sample(lengths)
            history.append(("user", words(text, k)))
            conv.append(WorkItem(m, tuple(history), conv=len(convs), turn=turn, new_tokens=k, cls=mix.cls or mix.name))
            history.append(("assistant", words(text, m)))  # stands in for the answer; its length is max_tokens
        convs.append(conv)
        total += len(conv)
    users: list[list[WorkItem]] = [[] for _ in range(max(1, active))]
    for conv in convs:
        min(users, key=len).extend(conv)
    order = [u[k] for k in range(max(map(len, users))) for u in users if k < len(u)]
    return order[:n]  # a cut keeps every kept turn's predecessors


def _class_order(mix: Mix, n: int, rng: random.Random) -> list[Mix]:
    """The shape of each of `n` single-turn requests: class i gets round(cum. share to i x n) -
    round(cum. share before i x n) of them (exact shares, summing to n), shuffled by `rng`."""
    if not mix.mixed_in:
        return [mix] * n
    order: list[Mix] = []
    cum = 0.0
    for share, shape in mix.classes:
        start = round(cum * n)
        cum += share
        order += [shape] * (round(cum * n) - start)
    order += [mix.classes[-1][1]] * (n - len(order))  # float sums that end just under 1
    rng.shuffle(order)
    return order


def load_jsonl(path: str | Path, default_max_tokens: int = 128) -> list[WorkItem]:
    """{"prompt": str, "max_tokens"?: int} or {"messages": [{"role", "content"}, ...], "max_tokens"?: int}
    per line. Raises ValueError naming the line of the first bad record."""
    items = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec: dict[str, Any] = json.loads(line)
            max_tokens = int(rec.get("max_tokens", default_max_tokens))
            if "messages" in rec:
                msgs = tuple((str(m["role"]), str(m["content"])) for m in rec["messages"])
                if not msgs:
                    raise ValueError("empty messages")
                items.append(WorkItem(max_tokens, msgs))
            elif isinstance(rec.get("prompt"), str):
                items.append(WorkItem(max_tokens, prompt=rec["prompt"]))
            else:
                raise ValueError('needs "prompt" (a string) or "messages"')
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{i}: {e}") from None
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items
