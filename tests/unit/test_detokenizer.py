from __future__ import annotations

from collections.abc import Sequence

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.model_files import default_model_path
from engine.tokenizer import Tokenizer

TEXTS = [
    "Hello world, this is a plain English sentence.",
    "🤖 robots 👍🏽 and flags 🇺🇸 ❤️",
    "日本語のテキスト、中文测试，한국어 텍스트입니다",
    "Café naïve résumé façade Ångström ß",
    "def f(x):\n    return {'a': [x ** 2, 3.14]}  # comment\n",
    "  leading\tand\n\n\ttrailing whitespace   \n",
    "Numbers 12345 and 3.14159, dates 2024-01-01",
    "mixed 🤖日本 é\u200bzero-width",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


def stream(
    tok: Tokenizer,
    ids: Sequence[int],
    prompt: str = "Say something:",
    stop: Sequence[str] = (),
    chunk: int = 1,
    skip_special_tokens: bool = True,
    include_stop: bool = False,
) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), stop, skip_special_tokens, include_stop)
    pieces = [detok.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.flush())
    return pieces, detok


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_concat_equals_full_decode(tok: Tokenizer, text: str, chunk: int) -> None:
    ids = tok.encode(text)
    pieces, detok = stream(tok, ids, chunk=chunk)
    assert "".join(pieces) == detok.text == tok.decode(ids) == text
    assert detok.stop_hit is None
    assert not any("\ufffd" in piece for piece in pieces)


def test_multibyte_characters_come_out_whole(tok: Tokenizer) -> None:
    ids = tok.encode("🤖")
    assert len(ids) == 3  # one emoji, three byte-level tokens
    pieces, _ = stream(tok, ids)
    assert pieces == ["", "", "🤖", ""]

    pieces, _ = stream(tok, tok.encode("日本語"))
    assert [p for p in pieces if p] == ["日", "本", "語"]


def test_prompt_context_and_short_prompts(tok: Tokenizer) -> None:
    ids = tok.encode(" world and more")
    for prompt in ["", "Hi", "A much longer prompt that has many more than five tokens in it"]:
        pieces, detok = stream(tok, ids, prompt=prompt)
        assert "".join(pieces) == detok.text == " world and more"


def test_window_stays_small(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    decoded_lengths: list[int] = []
    decode = tok.decode

    def recording_decode(ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        decoded_lengths.append(len(ids))
        return decode(ids, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", recording_decode)
    ids = tok.encode(" ".join(TEXTS) * 5)
    assert len(ids) > 500
    pieces, detok = stream(tok, ids, prompt="a prompt " * 50)
    assert "".join(pieces) == detok.text == decode(ids)
    assert max(decoded_lengths) <= 5 + 4  # the context plus at most one character's worth of byte tokens


def test_incomplete_character_at_end_is_flushed_like_decode(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🤖")[:-1]
    detok = IncrementalDetokenizer(tok, [])
    streamed = [detok.step([i]) for i in ids]
    assert "".join(streamed) == "ok"
    tail = detok.flush()
    assert "".join(streamed) + tail == detok.text == tok.decode(ids)
    assert tail.endswith("\ufffd")


def test_single_stop_string(tok: Tokenizer) -> None:
    pieces, detok = stream(tok, tok.encode("The answer is 42. END and then more text"), stop=["END"])
    assert detok.stop_hit == "END"
    assert "".join(pieces) == detok.text == "The answer is 42. "


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    text = "first line\n\nsecond line STOP third"
    pieces, detok = stream(tok, tok.encode(text), stop=["STOP", "\n\n", "never"])
    assert detok.stop_hit == "\n\n"
    assert "".join(pieces) == detok.text == "first line"


def test_stop_string_spanning_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world, again")
    assert tok.decode(ids[:1]) == "Hello"  # "lo wor" spans the first two tokens
    pieces, detok = stream(tok, ids, stop=["lo wor"])
    assert detok.stop_hit == "lo wor"
    assert pieces[0] == "Hel"  # "lo" is held back from the first token
    assert "".join(pieces) == detok.text == "Hel"


def test_a_stop_string_included_ends_the_text_and_only_the_first(tok: Tokenizer) -> None:
    """vLLM's include_stop_str_in_output, a stop string across tokens and in one piece."""
    for chunk in (1, 3):
        text = "first line\n\nsecond line STOP third STOP"
        pieces, detok = stream(tok, tok.encode(text), stop=["STOP", "d li"], chunk=chunk, include_stop=True)
        assert detok.stop_hit == "d li" and "".join(pieces) == detok.text == "first line\n\nsecond li"


def test_stop_string_inside_multibyte_text(tok: Tokenizer) -> None:
    pieces, detok = stream(tok, tok.encode("日本語のテキスト"), stop=["語の"])
    assert "".join(pieces) == detok.text == "日本"
    assert not any("\ufffd" in p for p in pieces)


def test_stop_string_at_start(tok: Tokenizer) -> None:
    pieces, detok = stream(tok, tok.encode("STOP right away, then more"), stop=["STOP"])
    assert detok.stop_hit == "STOP"
    assert pieces == ["", *[""] * (len(pieces) - 1)]
    assert detok.text == ""


def test_nothing_is_emitted_after_a_stop(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["END"])
    assert detok.step(tok.encode("a END")) == "a "
    assert detok.step(tok.encode(" more text")) == ""
    assert detok.flush() == ""
    assert detok.text == "a "


def test_held_back_partial_stop_is_released(tok: Tokenizer) -> None:
    ids = tok.encode("the END of it")
    detok = IncrementalDetokenizer(tok, [], stop=["ENDING"])
    pieces = [detok.step([i]) for i in ids]
    assert pieces[:2] == ["the", " "]  # "END" could start "ENDING": held
    assert detok.text.startswith("the END")
    pieces.append(detok.flush())
    assert detok.stop_hit is None
    assert "".join(pieces) == detok.text == "the END of it"


def test_partial_stop_at_end_is_flushed(tok: Tokenizer) -> None:
    pieces, detok = stream(tok, tok.encode("it ends with EN"), stop=["END"])
    assert pieces[-1] == "EN"
    assert detok.stop_hit is None
    assert "".join(pieces) == detok.text == "it ends with EN"


def test_client_never_sees_part_of_a_stop_string(tok: Tokenizer) -> None:
    stop = "<<STOP>>"
    for text in ["a<<STOP>>b", "a <<STO and <<STOP>> b", "<<<<STOP>>", "x <<ST"]:
        pieces, detok = stream(tok, tok.encode(text), stop=[stop])
        sent = ""
        for piece in pieces[:-1]:
            sent += piece
            assert stop not in sent
        assert "".join(pieces) == detok.text == text.split(stop)[0]


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok: Tokenizer, skip: bool) -> None:
    ids = tok.encode("<|im_start|>assistant\nHi there<|im_end|>")
    assert ids[0] in tok.special_token_ids and ids[-1] in tok.special_token_ids
    pieces, detok = stream(tok, ids, skip_special_tokens=skip)
    expected = "assistant\nHi there" if skip else "<|im_start|>assistant\nHi there<|im_end|>"
    assert "".join(pieces) == detok.text == tok.decode(ids, skip_special_tokens=skip) == expected


def test_a_stop_string_before_min_tokens_does_not_stop(tok: Tokenizer) -> None:
    """An answer short of its `min_tokens` (stops=False) sends its text whole; a stop string
    counts in the text decoded from then on."""
    ids = tok.encode(" stop here, then stop again.")
    detok = IncrementalDetokenizer(tok, tok.encode("Say:"), stop=["stop"])
    early = [detok.step(ids[i : i + 1], stops=False) for i in range(3)]  # " stop here,"
    assert "".join(early) == tok.decode(ids[:3]) and detok.stop_hit is None
    late = [detok.step(ids[i : i + 1]) for i in range(3, len(ids))]
    assert detok.stop_hit == "stop" and "".join(early + late) == tok.decode(ids).split(" stop again")[0] + " "
