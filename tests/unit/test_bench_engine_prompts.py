"""`tandem bench engine`'s prompts (bench.engine_bench.Prompts): each row it measures is new to
the prefix cache. A 4K row that found the 512-token row's prompts cached, and an 8K row the 4K
row's, measured half the work of an 8K prefill and reported it as the whole."""

from __future__ import annotations

from typing import Any, cast

from bench.engine_bench import Prompts
from engine.engine import Engine


class WordTokenizer:
    """One token a word (the tokenizer is the only part of the engine make_prompts reads)."""

    def encode(self, text: str) -> list[int]:
        return [1000 + len(w) for w in text.split()]


class TokenizerOnly:
    tokenizer: Any = WordTokenizer()


def test_no_row_shares_a_block_with_an_earlier_row() -> None:
    prompts = Prompts(cast(Engine, TokenizerOnly()))
    rows = [prompts.take(64, 32), prompts.take(4, 512), prompts.take(3, 4096), prompts.take(3, 8000)]
    assert [{len(p) for p in row} for row in rows] == [{32}, {512}, {4096}, {8000}]
    firsts = [tuple(p[:16]) for row in rows for p in row]  # a prompt's first block: its whole hash chain
    assert len(set(firsts)) == len(firsts) == 74
    # the same number in two rows would be one prompt's prefix of the other's
    assert rows[3][0][:4096] != rows[2][0]
