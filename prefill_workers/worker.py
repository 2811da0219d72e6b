"""PrefillWorker: runs prompts (batched, chunked, prefix-cached) and streams their KV out.

Each call names the decode worker's reservation; the KV goes there layer by layer while
the prompt computes. The call returns the first token and where the time went.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.loop import RequestStream
from engine.messages import TokenOutput
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.worker_base import WorkerBase
from kv_transfer import write_back
from kv_transfer.errors import KVTransferError
from kv_transfer.push import KVPush
from kv_transfer.receiver import KVReceiver
from kv_transfer.security import KVTLSConfig
from kv_transfer.sender import KVClients, KVTransferClient
from kv_transfer.server import KVTransferServer
from kv_transfer.stats import TransferStats
from kv_transfer.streaming import LayerStreamer
from kv_transfer.write_back import WriteBackTicket
from protos.gen import kv_transfer_pb2 as pb

_POLL_S = 0.25


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill hands back: the first token (as the decode side would have emitted it,
    `finished` when the request already ended there), where the time went, what moved."""

    first: TokenOutput
    cached_tokens: int
    queue_s: float
    prefill_s: float
    transfer_s: float
    transfer: TransferStats

    def timing(self) -> dict[str, float]:
        return {"queue_s": self.queue_s, "prefill_s": self.prefill_s, "transfer_s": self.transfer_s}


class PrefillWorker(WorkerBase):
    role = "prefill"

    def __init__(
        self,
        worker_id: str,
        model_path: str,
        config: EngineConfig,
        transport: str = "grpc",
        timeout_s: float = 10.0,
        tls: KVTLSConfig | None = None,
        host: str = "127.0.0.1",
        core: WorkerBase | None = None,
    ) -> None:
        """`tls`: dial decode workers' KV endpoints over TLS (and serve write-backs over it);
        None: plaintext. `host`: where this worker's KV endpoint, for write-backs, listens.
        `core`: a role flip's (engine/worker_base.py)."""
        super().__init__(worker_id, model_path, config, core)
        self.transport = transport
        self.timeout_s = timeout_s
        self.tls = tls
        self.streamer = LayerStreamer(self.engine)
        self.clients = KVClients(lambda endpoint: KVTransferClient(endpoint, transport, timeout_s, tls=tls))
        self.host = host
        self._inbound: tuple[KVReceiver, KVTransferServer] | None = None
        self._inbound_lock = threading.Lock()

    # ---- write-back (kv_transfer/write_back.py): decode workers copy answers' KV in here --------

    def reserve_write_back(self, request_id: str, keys: list[int]) -> WriteBackTicket | None:
        """Reserve what this cache lacks of `keys`' full blocks (None: nothing)."""
        self._check_open()
        return write_back.reserve_uncached(self._receiver(), request_id, keys)

    def adopt_write_back(self, request_id: str, keys: list[int]) -> None:
        """A committed write-back into the prefix cache."""
        write_back.adopt(self._receiver(), request_id, keys)

    def _receiver(self) -> KVReceiver:
        """This worker's KV endpoint, started on the first write-back."""
        with self._inbound_lock:
            if self._inbound is None:
                receiver = KVReceiver(self.engine, self.loop.lock)
                self._inbound = receiver, KVTransferServer(receiver, host=self.host, tls=self.tls).start()
            return self._inbound[0]

    def prefill(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        reservation: bytes,
        traceparent: str | None = None,
    ) -> PrefillResult:
        """Prefill, stream KV to `reservation` (a serialized ReserveResponse), commit; recorded as
        a span under `traceparent` (engine/spans.py).

        Waits as long as the prompt takes to compute (no fixed deadline: a long prompt or a
        long queue is not a failure); `abort(request_id)` ends it early, and the transfer has
        its own progress deadline. Raises KVTransferError (the decode side frees its lease),
        InvalidRequestError."""
        self.spans.begin(request_id, "worker.prefill", traceparent, {"tandem.prompt_tokens": len(prompt_ids)})
        try:
            r = self._prefill(request_id, prompt_ids, params, reservation)
        except BaseException as e:
            self.spans.end(request_id, error=f"{type(e).__name__}: {e}")
            raise
        self.spans.end(request_id, {"tandem.cached_tokens": r.cached_tokens, "tandem.queue_s": r.queue_s,
                                    "tandem.transfer_bytes": r.transfer.bytes})  # fmt: skip
        return r

    def _prefill(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, reservation: bytes
    ) -> PrefillResult:
        self._check_open()
        self.engine.prepare(params)
        res = pb.ReserveResponse.FromString(reservation)
        t0 = time.monotonic()
        client = self.clients.get(res.endpoint)
        push = client.push(request_id, res)  # fails on its own if the receiver stops taking data
        self.streamer.track(request_id, push)
        try:
            stream = self.loop.open(request_id, lambda: self.engine.add_request(request_id, list(prompt_ids), params))
            first = _first_output(stream, push)
            t1 = time.monotonic()
        except BaseException:
            self.streamer.untrack(request_id)
            push.abort("prefill failed")
            self.loop.abort(request_id)
            raise
        self.streamer.untrack(request_id)
        try:
            if first.finish_reason == "abort":
                raise KVTransferError(f"request {request_id!r} was aborted during prefill")
            stats = push.commit(len(prompt_ids))
        except BaseException:
            push.abort("commit failed")
            raise
        finally:  # its blocks stay held until the loop's next step: no wait for the step in progress
            self.loop.later(lambda e: e.release(request_id))
        out = TokenOutput.of(first)
        if first.finish_reason == "prefill_done":
            out = dataclasses.replace(out, finished=False, finish_reason=None, num_cached_tokens=0)
        return PrefillResult(
            first=out,
            cached_tokens=first.num_cached_tokens,
            queue_s=first.queue_s,
            prefill_s=t1 - t0 - first.queue_s,
            transfer_s=time.monotonic() - t1,
            transfer=stats,
        )

    def close_role(self) -> None:
        with self._inbound_lock:
            inbound, self._inbound = self._inbound, None
        if inbound is not None:
            inbound[1].stop(0)
        self.clients.close()

    def check_integrity(self) -> None:
        if self._inbound is not None:
            self._inbound[0].check_integrity()  # the engine's too
        else:
            super().check_integrity()


def _first_output(stream: RequestStream, push: KVPush) -> RequestOutput:
    """The request's first output, however long the queue and the prompt take; the transfer's
    error as soon as it has one (no use computing what cannot be delivered)."""
    while True:
        try:
            return stream.get(_POLL_S)
        except TimeoutError:
            if push.error is not None:
                raise push.error from None
