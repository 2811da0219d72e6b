"""`tandem serve` refuses a taken port at once, before Ray, Redis or a worker starts."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from router.port_check import PortUnavailable, check_port_free
from router.server import main
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def listening() -> Iterator[int]:
    """A port that a socket listens on, for the test's duration."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_listening_port_is_taken(listening: int) -> None:
    with pytest.raises(PortUnavailable) as err:
        check_port_free("127.0.0.1", listening)
    assert str(err.value) == (
        f"port {listening} on 127.0.0.1 is taken (Address already in use); pick another with --port"
    )
    assert err.value.port == listening and "\n" not in str(err.value)
    with pytest.raises(PortUnavailable):
        check_port_free("0.0.0.0", listening)  # the wildcard overlaps the loopback listener


def test_a_free_port_passes_and_is_left_free() -> None:
    port = free_port()
    check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # the check let it go


def test_a_port_in_time_wait_is_free_as_for_uvicorn() -> None:
    """The port of a server that just stopped, set up as uvicorn's (SO_REUSEADDR): Linux lets a
    new SO_REUSEADDR socket bind over its TIME_WAIT connections, and so does the check."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server side closes first: its end of the connection enters TIME_WAIT
        client.recv(1)
        client.close()
    check_port_free("127.0.0.1", port)


def test_a_host_that_is_not_local_says_so() -> None:
    with pytest.raises(PortUnavailable, match=r"cannot listen on port \d+ on nosuchhost\.invalid"):
        check_port_free("nosuchhost.invalid", free_port())


def test_serve_on_a_taken_port_exits_at_once_without_starting_ray(listening: int) -> None:
    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_:
        main(["--port", str(listening), "--host", "127.0.0.1"])
    assert time.monotonic() - started < 1.0
    assert exit_.value.code == (
        f"tandem serve: port {listening} on 127.0.0.1 is taken (Address already in use); pick another with --port"
    )  # a string code: Python prints it to stderr and exits with status 1
    assert not ray.is_initialized()


def test_the_command_prints_one_line_on_stderr_and_exits_nonzero(listening: int) -> None:
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "cli.main", "serve", "--port", str(listening)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert run.returncode == 1 and run.stdout == ""
    said = f"tandem serve: port {listening} on 127.0.0.1 is taken (Address already in use); pick another with --port"
    assert run.stderr == said + "\n"
    assert time.monotonic() - started < 5.0  # interpreter start and imports included


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_port_out_of_range_is_a_usage_error(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([f"--port={port}"])
    assert exit_.value.code == 2 and f"argument --port: '{port}' is not a TCP port" in capsys.readouterr().err


@pytest.mark.parametrize("blocks", ["0", "-3", "lots"])
def test_a_bad_block_count_is_a_usage_error(blocks: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([f"--num-blocks={blocks}"])
    assert exit_.value.code == 2
    assert f"argument --num-blocks: '{blocks}' is not a number of blocks (>= 1) or auto" in capsys.readouterr().err
    assert not ray.is_initialized()


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--model", "/no/such.gguf"], "argument --model: /no/such.gguf: no such file or directory"),
        (["--model", str(ROOT / "README.md")], "README.md is neither a .gguf file nor a directory with config.json"),
        (["--prefill", "-1"], "argument --prefill: '-1' is not a number of workers (>= 0)"),
        (["--colocated", "two"], "argument --colocated: 'two' is not a number of workers (>= 0)"),
        (["--prefill", "0", "--decode", "0"], "no workers to serve with: --prefill and --decode (or --colocated N)"),
    ],
)
def test_a_model_or_worker_count_that_cannot_serve_is_a_usage_error(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each used to start Ray: a model path that holds none failed in every worker 15 s later, a
    negative count in a traceback, none at all waited for workers forever."""
    for joins in ("RAY_ADDRESS", "REDIS_URL"):
        monkeypatch.delenv(joins, raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["--port", str(free_port()), *flags])
    assert exit_.value.code == 2 and said in capsys.readouterr().err
    assert not ray.is_initialized()


def test_a_cluster_config_refuses_a_negative_pool() -> None:
    from cluster.config import ClusterConfig

    with pytest.raises(ValueError, match="decode must be a number of workers >= 0, got -1"):
        ClusterConfig(decode=-1)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--max-prefill-chunk", "-1"], "max_prefill_chunk must be >= 0"),
        (["--max-running", "0"], "--max-running: Input should be greater than or equal to 1"),
        (["--max-attempts", "6"], "--max-attempts: Input should be less than or equal to 5"),
        (["--max-migrations", "-1"], "max_migrations must be >= 0, got -1"),
        (["--queue-timeout", "0", "--spill-streams", "-1"], "--queue-timeout: Input should be greater than 0; --spill"),
    ],
)
def test_a_bad_engine_or_router_option_is_one_line_before_anything_starts(flags: list[str], said: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--port", str(free_port()), *flags])
    assert str(exit_.value.code).startswith("tandem serve: ") and said in str(exit_.value.code)
    assert not ray.is_initialized()


def test_the_retry_budgets_reach_the_router_and_the_cluster() -> None:
    from router.serve_args import parse
    from router.server import _settings

    assert _settings(parse([])).max_attempts == 2 and parse([]).max_migrations == 2
    args = parse(["--max-attempts", "4", "--max-migrations", "0"])
    assert _settings(args).max_attempts == 4 and args.max_migrations == 0
