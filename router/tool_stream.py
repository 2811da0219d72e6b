"""A tool-calling answer streamed as it is written (router/tools.py's JSON, read incrementally):
the text of `{"response": "..."}` as content, a character at a time as its JSON string decodes,
and each call of `{"tool_call": ...}` / `{"tool_calls": [...]}` as OpenAI streams one: its id and
name once the name is whole, then its arguments' JSON text as it grows.

The grammar (engine/grammar.py) writes the answer compact, keys in the schema's order, so the
reader knows each next character's place. Text it cannot place (an answer that is not this
JSON) stops the reading: nothing more is sent from it, and the answer's end tells the caller
(`ToolStream.settled` false) to send what router/tools.py reads from the whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from router.tools import ToolCall, call_id

RESPONSE = '{"response": "'
ONE_CALL = '{"tool_call": '
CALLS = '{"tool_calls": ['
NAME = '{"name": "'
ARGUMENTS = '", "arguments": '


@dataclass
class Delta:
    """What one piece of the answer adds: content, and calls begun or continued (index, the call
    where it begins, else None, and arguments text)."""

    content: str = ""
    calls: list[tuple[int, ToolCall | None, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def add(self, index: int, begun: ToolCall | None, arguments: str) -> None:
        """A call's part, joined to the one before where that was the same call's (one entry a
        call a delta, as OpenAI sends them)."""
        if self.calls and self.calls[-1][0] == index:
            i, was, before = self.calls[-1]
            self.calls[-1] = (i, was, before + arguments)
        else:
            self.calls.append((index, begun, arguments))


class ToolStream:
    """Reads one choice's answer as its text comes (`feed`), keeping its place."""

    def __init__(self) -> None:
        self._text = ""
        self._at = 0  # the next character to read
        self._state = "head"  # head, content, call, name, args, between, done, lost
        self._index = -1  # the call under way
        self._name_from = 0
        self._depth = 0  # the arguments' nesting, and whether the scan is in a string of them
        self._in_string = False
        self._escaped = False
        self._many = False  # a list of calls
        self.calls: list[ToolCall] = []
        self.content: list[str] = []

    @property
    def settled(self) -> bool:
        """Whether the answer read as the JSON it should be, to its end."""
        return self._state == "done"

    @property
    def lost(self) -> bool:
        return self._state == "lost"

    def feed(self, text: str) -> Delta:
        """The next piece of the answer's text -> what it adds."""
        self._text += text
        delta = Delta()
        while self._at < len(self._text) and self._state not in ("done", "lost"):
            if not self._step(delta):
                break  # more text is needed to go on
        return delta

    def _step(self, delta: Delta) -> bool:
        rest = self._text[self._at :]
        if self._state == "head":
            return self._head(rest)
        if self._state == "content":
            return self._content(rest, delta)
        if self._state == "call":
            return self._expect(rest, NAME, "name")
        if self._state == "name":
            return self._name(delta)
        if self._state == "args":
            return self._args(delta)
        return self._between(rest)

    def _head(self, rest: str) -> bool:
        for prefix, state in ((RESPONSE, "content"), (ONE_CALL, "call"), (CALLS, "call")):
            if rest.startswith(prefix):
                self._at += len(prefix)
                self._state, self._many = state, prefix == CALLS
                return True
        if not any(p.startswith(rest) for p in (RESPONSE, ONE_CALL, CALLS)):
            self._state = "lost"
        return False

    def _expect(self, rest: str, what: str, then: str) -> bool:
        if rest.startswith(what):
            self._at += len(what)
            self._state = then
            self._name_from = self._at
            return True
        if not what.startswith(rest):
            self._state = "lost"
        return False

    def _content(self, rest: str, delta: Delta) -> bool:
        """The response's JSON string, decoded as far as whole characters go."""
        i, closed = 0, False
        while i < len(rest):
            c = rest[i]
            if c == '"':
                closed = True
                break
            if c != "\\":
                i += 1
                continue
            size = _escape_size(rest, i)
            if size == 0:
                break  # not whole yet
            i += size
        try:
            piece = json.loads('"' + rest[:i] + '"') if i else ""
        except ValueError:  # not a JSON string after all
            self._state = "lost"
            return False
        self._at += i + (1 if closed else 0)
        self._state = "done" if closed else "content"
        if piece:
            self.content.append(piece)
            delta.content += piece
        return False

    def _name(self, delta: Delta) -> bool:
        end = self._text.find('"', self._at)
        if end < 0:
            return False
        name = self._text[self._name_from : end]
        self._at = end
        if not self._text.startswith(ARGUMENTS, self._at):
            if not ARGUMENTS.startswith(self._text[self._at :]):
                self._state = "lost"
            return False
        self._at += len(ARGUMENTS)
        self._index += 1
        call = ToolCall(call_id(), name, "")
        self.calls.append(call)
        delta.add(self._index, call, "")
        self._state, self._depth, self._in_string, self._escaped = "args", 0, False, False
        return True

    def _args(self, delta: Delta) -> bool:
        """The arguments' JSON text, sent as it comes, to the brace that closes it."""
        start = i = self._at
        text = self._text
        while i < len(text):
            c = text[i]
            i += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._state = "between"
                    break
        piece = text[start:i]
        self._at = i
        call = self.calls[self._index]
        self.calls[self._index] = ToolCall(call.id, call.name, call.arguments + piece)
        delta.add(self._index, None, piece)
        return self._state == "between"

    def _between(self, rest: str) -> bool:
        """After a call's arguments: its object's brace, then the next call or the end."""
        ends = ("}]}", "}, ") if self._many else ("}}",)
        for end in ends:
            if rest.startswith(end):
                self._at += len(end)
                self._state = "call" if end == "}, " else "done"
                return self._state == "call"
        if not any(e.startswith(rest) for e in ends):
            self._state = "lost"
        return False


def _escape_size(text: str, i: int) -> int:
    """The length of the escape at text[i] ("\\"), a surrogate pair's two as one; 0 where the
    text ends before it can be told."""
    if i + 1 >= len(text):
        return 0
    if text[i + 1] != "u":
        return 2
    if i + 6 > len(text):
        return 0
    try:
        high = 0xD800 <= int(text[i + 2 : i + 6], 16) <= 0xDBFF
    except ValueError:
        return 6  # not an escape: json.loads says so
    if not high:  # one escape
        return 6
    tail = text[i + 6 : i + 8]
    if len(tail) < 2 and "\\u".startswith(tail):
        return 0  # a low surrogate may follow
    return 12 if tail == "\\u" and i + 12 <= len(text) else (0 if tail == "\\u" else 6)
