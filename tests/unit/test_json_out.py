"""`--json` keeps stdout to the command's one object (bench/json_out.py)."""

from __future__ import annotations

import json
import signal
import threading

import pytest

from bench.json_out import json_only, print_json, sub_command
from cli.main import main


def test_print_json_alone_on_stdout_while_threads_and_sub_commands_print(capsys: pytest.CaptureFixture[str]) -> None:
    with json_only():
        print("before")
        t = threading.Thread(target=print, args=("(raylet) A worker died",))  # Ray prints from a thread
        t.start()
        t.join()
        with sub_command():  # a command run by this one, asked for its own --json
            print_json({"inner": 1})
        print_json({"outer": 1})
    out, err = capsys.readouterr()
    assert json.loads(out) == {"outer": 1}
    assert "before" in err and "(raylet)" in err and json.loads(err.splitlines()[-1]) == {"inner": 1}


def test_a_sub_command_prints_on_stderr_outside_json_only_too(capsys: pytest.CaptureFixture[str]) -> None:
    with sub_command():  # the planner's own main, called as a function
        print("report")
        print_json({"inner": 1})
    print_json({"outer": 1})
    out, err = capsys.readouterr()
    assert json.loads(out) == {"outer": 1} and err.splitlines() == ["report", '{"inner": 1}']


def test_print_json_without_json_only_is_a_plain_print(capsys: pytest.CaptureFixture[str]) -> None:
    print_json({"a": [1, 2]}, indent=1)
    assert json.loads(capsys.readouterr().out) == {"a": [1, 2]}


def test_tandem_bench_json_prints_one_object(capsys: pytest.CaptureFixture[str]) -> None:
    previous = signal.getsignal(signal.SIGTERM)  # the router bench makes SIGTERM unwind like Ctrl-C
    try:
        assert main(["bench", "router", "--null-only", "--null-rounds", "3", "--json"]) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    out, _ = capsys.readouterr()
    assert isinstance(json.loads(out), dict)  # one document: nothing else on stdout
