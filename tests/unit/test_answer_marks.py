"""Where a chat's earlier answers lie in its templated prompt (router/answer_marks.py): found by
one render with placeholders, whatever the number of turns; a quote of an answer never counts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers.models import WordLevel

from engine.tokenizer import Tokenizer
from router.answer_marks import MAX_RENDERS, answer_spans

CHATML = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def with_template(chat_template: str) -> Tokenizer:
    backend = Backend(WordLevel({"<unk>": 0, "</s>": 1}, unk_token="<unk>"))
    return Tokenizer(
        backend, eos_token_id=1, bos_token_id=None, stop_token_ids=frozenset(), special_token_ids=frozenset(),
        chat_template=chat_template,
    )  # fmt: skip


def counted(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lengths of the message lists the template renders from now on."""
    renders: list[int] = []
    render = tok.apply_chat_template

    def counting(msgs: Sequence[Mapping[str, str]], add_generation_prompt: bool = True, variables: Any = None) -> str:
        renders.append(len(msgs))
        return render(msgs, add_generation_prompt, variables)

    monkeypatch.setattr(tok, "apply_chat_template", counting)
    return renders


def chat(answers: list[str], quote: int | None = None) -> list[dict[str, str]]:
    """A user turn before each answer, and a last one; the one after answer `quote` quotes it."""
    msgs: list[dict[str, str]] = []
    for i, a in enumerate(answers):
        msgs += [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": a}]
    msgs.append({"role": "user", "content": "Thanks."})
    if quote is not None:
        msgs[2 * quote] = {"role": "user", "content": f"Say '{answers[quote]}' again."}
    return msgs


def answered(tok: Tokenizer, msgs: list[dict[str, str]], spans: list[tuple[int, int]]) -> list[str]:
    """The answers as marked, each checked to follow its own assistant header (not a quote)."""
    text = tok.apply_chat_template(msgs)
    assert all(text[:a].endswith("<|assistant|>") for a, _ in spans), "a mark outside an answer"
    return [text[a:b] for a, b in spans]


def test_one_render_marks_every_answer_and_not_a_quote_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = with_template(CHATML)
    answers = ["Paris is the capital.", "ok", "ok", "About 2 million."]
    msgs = chat(answers, quote=3)
    text = tok.apply_chat_template(msgs)
    renders = counted(tok, monkeypatch)
    spans = answer_spans(tok, msgs, text)
    assert renders == [len(msgs)]
    assert answered(tok, msgs, spans) == answers


def test_a_thousand_identical_answers_cost_one_render(monkeypatch: pytest.MonkeyPatch) -> None:
    """Searching, each "ok" occurs again later: the fallback renders the history before it,
    O(turns^2) for every answer; one render marks them all."""
    tok = with_template(CHATML)
    msgs = chat(["ok"] * 1000)
    text = tok.apply_chat_template(msgs)
    renders = counted(tok, monkeypatch)
    spans = answer_spans(tok, msgs, text)
    assert renders == [len(msgs)]
    assert answered(tok, msgs, spans) == ["ok"] * 1000


@pytest.mark.parametrize("why", ["a template that drops NULs", "a client's text that looks like a placeholder"])
def test_where_placeholders_do_not_place_the_answers_each_is_searched_for(
    why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quoted answer is searched from the end of the history's rendering before it; that
    rendering is done for at most MAX_RENDERS answers."""
    drops = why.startswith("a template")
    tok = with_template(CHATML.replace("m.content", 'm.content | replace("\\x00", "")') if drops else CHATML)
    answers = ["Paris is the capital.", "About 2 million.", *["ok"] * 20]
    msgs = chat(answers, quote=1)
    if not drops:
        msgs[-1] = {"role": "user", "content": "\x00answer 1\x00"}
    text = tok.apply_chat_template(msgs)
    renders = counted(tok, monkeypatch)
    spans = answer_spans(tok, msgs, text)
    assert renders[0] == len(msgs) and renders[1:3] == [3, 5], "the placeholders, then the history before 1 and 2"
    assert len(renders) == 1 + MAX_RENDERS, "and before each answer found more than once, MAX_RENDERS in all"
    assert answered(tok, msgs, spans) == answers


def test_no_answer_no_render(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = with_template(CHATML)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "?"}]
    renders = counted(tok, monkeypatch)
    assert answer_spans(tok, msgs, "whatever") == [] and renders == []
