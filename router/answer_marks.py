"""Where a chat's earlier answers lie in its templated prompt (SamplingParams.decoded marks them,
so the engine runs them as the decode rows that wrote them).

The template is rendered once more with each answer replaced by a placeholder: where putting the
answers back gives the prompt, the placeholders' places are the answers'. A user quoting an
answer does not count, and the cost is one render and a scan, whatever the number of turns.

A template that changes an answer's text (strips it, say) fails that check. Then each answer is
looked for from the end of the last one found and, where it occurs more than once there (a user
may have quoted it first), from the end of the template's rendering of the messages before it,
for at most MAX_RENDERS answers: rendering for every answer costs O(turns^2) (77 ms of a
200-turn chat; with many identical short answers, seconds for one request's body).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from engine.tokenizer import Tokenizer

MAX_RENDERS = 8
_PLACEHOLDER = re.compile("\x00answer ([0-9]+)\x00")

Spans = list[tuple[int, int]]


def answer_spans(
    tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]], text: str, variables: Mapping[str, Any] | None = None
) -> Spans:
    """Each assistant message's content in `text` (`messages` through the chat template, with
    the generation prompt and the template `variables`), as sorted character spans [start, end);
    an answer not found gives none."""
    answers = {i: m["content"] for i, m in enumerate(messages) if m["role"] == "assistant" and m["content"]}
    if not answers:
        return []
    placed = _by_placeholders(tokenizer, messages, answers, text, variables)
    return placed if placed is not None else _by_search(tokenizer, messages, answers, text, variables)


def _by_placeholders(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, str]],
    answers: dict[int, str],
    text: str,
    variables: Mapping[str, Any] | None,
) -> Spans | None:
    """The spans, where the template renders each answer as it is; else None."""
    held = [{**m, "content": f"\x00answer {i}\x00"} if i in answers else dict(m) for i, m in enumerate(messages)]
    try:
        shape = tokenizer.apply_chat_template(held, True, variables)
    except Exception:  # a template that inspects the content may refuse a placeholder
        return None
    spans: Spans = []
    rebuilt: list[str] = []
    at = last = 0
    for hole in _PLACEHOLDER.finditer(shape):
        content = answers.get(int(hole.group(1)))
        if content is None:  # the placeholder's text in a message of the client's own
            return None
        rebuilt.append(shape[last : hole.start()])
        at += hole.start() - last
        spans.append((at, at + len(content)))
        rebuilt.append(content)
        at += len(content)
        last = hole.end()
    rebuilt.append(shape[last:])
    if len(spans) != len(answers) or "".join(rebuilt) != text:
        return None
    return spans


def _by_search(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, str]],
    answers: dict[int, str],
    text: str,
    variables: Mapping[str, Any] | None,
) -> Spans:
    marks: Spans = []
    renders = 0
    for i, content in answers.items():
        at = marks[-1][1] if marks else 0
        found = text.find(content, at)
        if found >= 0 and text.find(content, found + 1) >= 0 and renders < MAX_RENDERS:
            renders += 1
            try:
                before = tokenizer.apply_chat_template(messages[:i], False, variables)
                if text.startswith(before):
                    found = text.find(content, max(at, len(before)))
            except Exception:  # a template that refuses the shorter conversation: the first found
                pass
        if found >= 0:
            marks.append((found, found + len(content)))
    return marks
