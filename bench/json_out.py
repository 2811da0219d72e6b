"""`--json`: a command's one JSON object, alone on stdout.

While a command runs under `json_only()`, whatever else prints to stdout goes to stderr: Ray
writes its workers' errors ("(raylet) A worker died ...") to the driver's stdout from a thread
of its own, and a benchmark that runs another command (the planner runs `tandem profile` and
`tandem bench compare`) would print that one's JSON too. `print_json` writes to the stdout the
innermost `json_only()` found; a sub-command runs under `sub_command()`, all of it on stderr.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any, TextIO

_streams: list[TextIO] = []  # stdout as each open json_only() found it, innermost last


@contextlib.contextmanager
def json_only() -> Iterator[None]:
    """Send everything printed to stdout to stderr (in every thread) until the block ends,
    except `print_json`'s object."""
    _streams.append(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _streams.pop()


def print_json(obj: Any, indent: int | None = None) -> None:
    """`obj` as one JSON document, on the innermost `json_only()`'s stdout (else on stdout)."""
    out = _streams[-1] if _streams else sys.stdout
    print(json.dumps(obj, indent=indent), file=out, flush=True)


@contextlib.contextmanager
def sub_command() -> Iterator[None]:
    """Everything a command run by another prints, its `print_json` too, on stderr."""
    with contextlib.redirect_stdout(sys.stderr), json_only():
        yield
