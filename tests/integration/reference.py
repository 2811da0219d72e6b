"""The reference prompts the real-model tests share (HF parity, coded KV caches, long context, GPU)."""

from __future__ import annotations

from engine.engine import Engine

NEW_TOKENS = 64  # greedy tokens each reference prompt is checked over
CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a five-year-old.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
]
RAW = [
    "The quick brown fox",
    "def fibonacci(n):\n",
    "Once upon a time, in a land far away,",
    "The three laws of thermodynamics are",
    "1, 1, 2, 3, 5, 8,",
]


def reference_prompts(engine: Engine) -> list[list[int]]:
    """CHAT (each a user's message, through the chat template), then RAW, as token ids."""
    tok = engine.tokenizer
    assert tok is not None
    chats = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in CHAT]
    return [tok.encode(t) for t in chats + RAW]
