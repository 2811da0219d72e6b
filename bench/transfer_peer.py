"""The decode side of `tandem bench transfer`: a KVReceiver + KVTransferServer on a decode-role
engine, in a spawned process (its own GIL and model copy, as in production) or in-process."""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import secrets
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model import LlamaModel
from engine.sampling_params import SamplingParams
from kv_transfer.receiver import KVReceiver
from kv_transfer.server import KVTransferServer

LINK_TIMEOUT_S = 10.0
DECODE_PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def first_decode_token(receiver: KVReceiver, rid: str, prompt: list[int], first: int) -> int:
    """Admit a committed transfer and run one decode step; returns the token that step sampled."""
    receiver.wait(rid, 30)
    receiver.admit(rid, prompt, first, DECODE_PARAMS)
    with receiver.engine_lock:
        outs = [o.new_token_ids[0] for o in receiver.engine.step() if o.request_id == rid]
    assert len(outs) == 2 and outs[0] == first, outs  # the hand-off's token, then this step's
    return outs[1]


def _serve(engine: Engine, secret: str) -> tuple[KVReceiver, KVTransferServer]:
    receiver = KVReceiver(engine, threading.RLock(), lease_s=60, in_place=True)  # as decode workers do
    return receiver, KVTransferServer(receiver, secret=secret).start()


def link_collective(receiver: KVReceiver, port: int) -> str:
    """Connect the receiving end of a collective link and give `receiver` its reader; returns
    "" or why not. Imported here: kv_transfer/collective.py is optional to this benchmark."""
    try:
        coll = importlib.import_module("kv_transfer.collective")
        link = coll.CollectiveLink.connect(coll.LinkConfig(port, timeout_s=LINK_TIMEOUT_S), coll.RECEIVER)
        receiver.readers["collective"] = coll.CollectiveReader(link)
        return ""
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _worker(conn: Connection, path: str, config: EngineConfig, threads: int, secret: str) -> None:
    """The spawned decode process: load the model, serve, do what the parent sends until None."""
    torch.set_num_threads(threads)
    receiver, server = _serve(Engine.from_path(path, config), secret)
    conn.send(server.endpoint)
    while (job := conn.recv()) is not None:
        name, *a = job
        conn.send(first_decode_token(receiver, *a) if name == "admit" else link_collective(receiver, *a))
    server.stop(0)


class DecodePeer:
    """A KVReceiver + KVTransferServer on a decode-role engine: in a spawned process (its own
    GIL and its own copy of the model, as in production) or in this process on the same model.
    Clients Reserve on it with `secret`."""

    def __init__(self, model: LlamaModel | None, path: str, config: EngineConfig, threads: int) -> None:
        self.secret = secrets.token_hex(16)
        self._proc: BaseProcess | None = None
        self._endpoint: str | None = None
        if model is None:
            ctx = mp.get_context("spawn")
            self._conn, child = ctx.Pipe()
            self._proc = ctx.Process(target=_worker, args=(child, path, config, threads, self.secret), daemon=True)
            self._proc.start()
            child.close()
        else:
            self._receiver, self._server = _serve(Engine(model, None, config), self.secret)
            self._endpoint = self._server.endpoint

    def _recv(self) -> object:
        try:
            return self._conn.recv()
        except EOFError:
            raise RuntimeError("the decode worker process died (its traceback is above)") from None

    @property
    def endpoint(self) -> str:
        """The worker's gRPC address; waits for a spawned worker to finish loading."""
        if self._endpoint is None:
            self._endpoint = str(self._recv())
        return self._endpoint

    def first_token(self, rid: str, prompt: list[int], first: int) -> int:
        if self._proc is None:
            return first_decode_token(self._receiver, rid, prompt, first)
        self._conn.send(("admit", rid, prompt, first))
        token = self._recv()
        assert isinstance(token, int), token
        return token

    def open_collective(self, port: int) -> Callable[[], str]:
        """Start connecting the receiving end of a collective link (it waits for the sender);
        returns a function that waits for the outcome: "" or why it failed."""
        if self._proc is not None:
            self._conn.send(("collective", port))
            return lambda: str(self._recv())
        box: list[str] = []
        th = threading.Thread(target=lambda: box.append(link_collective(self._receiver, port)), daemon=True)
        th.start()

        def outcome() -> str:
            th.join(3 * LINK_TIMEOUT_S)
            return box[0] if box else "the receiving end never connected"

        return outcome

    def close(self) -> None:
        if self._proc is None:
            self._server.stop(0)
            return
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
