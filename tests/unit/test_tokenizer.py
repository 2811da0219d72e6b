"""The tokenizer under a router's load: encoding leaves the GIL to other threads (the router's
event loop), and marking a long text's spans reads its offsets once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from engine.tokenizer import Tokenizer


def runs_of_another_thread_during(call: Callable[[], object]) -> int:
    """How many times a second Python thread got to run while `call()` ran."""
    runs = 0
    stop, started = threading.Event(), threading.Event()

    def other() -> None:
        nonlocal runs
        started.set()
        while not stop.is_set():
            runs += 1
            time.sleep(0)

    t = threading.Thread(target=other)
    t.start()
    started.wait()
    before = runs
    call()
    during = runs - before
    stop.set()
    t.join()
    return during


def test_encoding_a_long_prompt_lets_other_threads_run(smollm_tokenizer: Tokenizer) -> None:
    """1.2 MB of text (~0.4 s to encode): the backend's `encode` held the GIL throughout (the
    other thread ran once; a router's event loop, and every stream it sends, stalled 0.65 s for
    a 2 MB prompt); `encode_batch`, which Tokenizer uses, releases it (thousands of runs)."""
    text = "hello world " * 100_000
    assert runs_of_another_thread_during(lambda: smollm_tokenizer.encode(text)) > 100
    assert runs_of_another_thread_during(lambda: smollm_tokenizer.encode_marking(text, [(6, 11)])) > 100


def test_marks_on_a_long_text_are_its_whole_tokens(smollm_tokenizer: Tokenizer) -> None:
    words = [f"word{i}" for i in range(5000)]
    text = " ".join(words)
    marked = [" word10 ", " word2500 ", " word4999"]  # a word's token carries the space before it
    marks = [(text.index(w), text.index(w) + len(w)) for w in marked]
    ids, spans = smollm_tokenizer.encode_marking(text, marks)
    assert ids == smollm_tokenizer.encode(text)
    assert [smollm_tokenizer.decode(ids[a:b]) for a, b in spans] == [" word10", " word2500", " word4999"]


def test_fewest_tokens_is_a_lower_bound(smollm_tokenizer: Tokenizer) -> None:
    """The GGUF tokenizer's longest token covers 81 characters (a newline and 80 spaces): no text
    encodes to fewer tokens than its length / 81, the worst texts included."""
    tok = smollm_tokenizer
    assert tok.max_token_chars == 81
    longest = "\n" + " " * 80
    for text in ("hello world " * 500, longest * 100, "#" * 80 * 50, "a", "<|im_start|>" * 40, "é" * 1000):
        assert 0 < tok.fewest_tokens(text) <= len(tok.encode(text)), text[:20]
    assert tok.fewest_tokens(longest * 100) == len(tok.encode(longest * 100)) == 100
