"""How `tandem serve` takes SIGINT and SIGTERM, from start to exit.

- While the cluster starts (`StartSignals`): a stop signal is recorded, the start stops at its
  next wait, and what has started is stopped. Ray's core worker puts in a C-level SIGTERM
  handler of its own that logs a stack and aborts (exit 134, for a `systemctl stop` during
  the load), so the handlers go in again once Ray is up.
- While uvicorn serves, it handles them (a graceful stop), and on its way out raises each again
  for the handler it found: `StartSignals`' one, which raises nothing, so the stop goes on to
  the cluster's shutdown and the process exits 0, as a stop asked for should. (Ray's init
  leaves a SIGTERM handler that calls sys.exit(15): a `systemctl stop` ended with status 15,
  which systemd counts as a failure, and went through Ray's exit hook.)
- During the shutdown, they do nothing (`absorb_stop_signals()`); every step of it is bounded
  (cluster/shutdown.py).
- If Ray stopped answering during the shutdown, `exit_past_ray()` leaves at once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import NoReturn

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StartSignals:
    """SIGINT and SIGTERM while the cluster starts: each is recorded (`requested`), and the start
    stops at its next wait, then what has started is stopped. Nothing is raised from the
    handler: raised inside a Ray call, an exception came out as a SystemError traceback."""

    def __init__(self) -> None:
        self.requested = threading.Event()

    def listen(self) -> None:
        """Put the handlers in; again after ray.init, whose core worker puts in a C-level SIGTERM
        handler of its own that logs a stack and aborts (exit 134)."""
        _handle(lambda signum, frame: self.requested.set())


def absorb_stop_signals() -> None:
    """Make SIGINT and SIGTERM do nothing: the shutdown is under way, and bounded."""
    _handle(lambda signum, frame: None)


def _handle(handler: Callable[[int, FrameType | None], None]) -> None:
    if threading.current_thread() is threading.main_thread():  # signal.signal works only there
        for sig in STOP_SIGNALS:
            signal.signal(sig, handler)


def exit_past_ray(code: int) -> NoReturn:
    """Exit now, without the interpreter's exit hooks: Ray stopped answering during shutdown
    (its raylet and GCS killed with this process's group, say). Its own exit hook would wait on
    them again, 8 s more; and unhooked, finalizing the interpreter under its stuck core worker
    segfaulted. Ray's reaper takes any of its processes left."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
