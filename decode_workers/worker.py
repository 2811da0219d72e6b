"""DecodeWorker: reserves blocks, receives KV over kv_transfer, decodes in continuous batches.

In the cluster, `start_decode` admits a request and its tokens go to the router's outbox
(engine/outbox.py: one batch per engine step for all of that router's requests, taken by long
polls); the local route (a next turn whose history this worker holds) is `start`, the whole
request here. `generate` streams one request's outputs to an in-process caller.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from engine.config import EngineConfig
from engine.messages import TokenOutput
from engine.sampling_params import SamplingParams
from engine.worker_base import WorkerBase
from kv_transfer.receiver import KVReceiver
from kv_transfer.security import KVTLSConfig
from kv_transfer.sender import KVClients, KVTransferClient
from kv_transfer.server import KVTransferServer
from kv_transfer.write_back import Adopt, Reserve, WriteBackResult, WriteBackSource


class DecodeWorker(WorkerBase):
    role = "decode"

    def __init__(
        self,
        worker_id: str,
        model_path: str,
        config: EngineConfig,
        host: str = "127.0.0.1",
        lease_s: float = 10.0,
        tls: KVTLSConfig | None = None,
        core: WorkerBase | None = None,
        in_place: bool = False,
    ) -> None:
        """`tls`: serve the KV endpoint over TLS (mutual with a CA file); None: plaintext.
        `core`: a role flip's (engine/worker_base.py). `in_place`: keep the cache in /dev/shm,
        for same-host prefill workers on `--transport shm` to write it in place."""
        super().__init__(worker_id, model_path, config, core)
        self.receiver = KVReceiver(self.engine, self.loop.lock, lease_s=lease_s, in_place=in_place)
        self.server = KVTransferServer(self.receiver, host=host, tls=tls).start()
        self.endpoint = self.server.endpoint
        clients = KVClients(lambda endpoint: KVTransferClient(endpoint, "grpc", tls=tls))
        self.write_back_source = WriteBackSource(self.engine, self.loop.lock, clients)
        self.outboxes.on_lost.append(self._router_gone)

    def reserve(self, request_id: str, num_tokens: int, lease_s: float | None = None, owner: str = "") -> bytes:
        """Claim blocks for a prompt's KV; a serialized ReserveResponse (endpoint, token, blocks).
        `lease_s`: how long they wait for the first chunk (default: the receiver's lease).
        `owner`: the router's feed subscriber: once its feed has broken and it has not come back
        (engine/outbox.py: the router is gone), its reservations go too, not at their leases' end."""
        self._check_open()
        self.outboxes.seen(owner)
        return bytes(self.receiver.reserve(request_id, num_tokens, lease_s, owner).SerializeToString())

    def _router_gone(self, subscriber: str) -> None:
        for rid in self.receiver.owned_by(subscriber):
            self.receiver.release(rid, None, "its router is gone")

    def release(self, request_id: str) -> bool:
        return self.receiver.release(request_id, None, "released by caller")

    def abort(self, request_id: str) -> bool:
        """Stop the request, whether it runs or still waits on its transfer (its reservation is
        released through the receiver, which owns it)."""
        released = self.receiver.release(request_id, None, "aborted by caller")
        return super().abort(request_id) or released

    def renew(self, request_id: str, lease_s: float) -> bool:
        return self.receiver.renew(request_id, lease_s)

    def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        first_token: int,
        params: SamplingParams,
        transfer_timeout_s: float = 10.0,
        step_timeout_s: float = 30.0,
    ) -> Iterator[TokenOutput]:
        """Wait for the verified transfer, admit, then yield outputs until the request finishes."""
        self.receiver.wait(request_id, transfer_timeout_s)
        stream = self.loop.open(request_id, lambda: self.receiver.admit(request_id, prompt_ids, first_token, params))
        try:
            for out in stream.iterate(step_timeout_s):
                yield TokenOutput.of(out)
        finally:
            self.loop.abort(request_id)  # no-op once finished; frees blocks if the caller went away

    def start_decode(
        self,
        subscriber: str,
        request_id: str,
        prompt_ids: Sequence[int],
        first_token: int,
        params: SamplingParams,
        transfer_timeout_s: float = 10.0,
        traceparent: str | None = None,
    ) -> None:
        """`generate`, its outputs going to `subscriber`'s outbox (`take_outputs`): returns once the
        verified transfer is admitted. `traceparent`: as `start`. Raises KVTransferError,
        TransferTimeout."""
        self.spans.begin(request_id, "worker.decode", traceparent, {"tandem.prompt_tokens": len(prompt_ids)})
        try:
            self.receiver.wait(request_id, transfer_timeout_s)
        except BaseException as e:
            self.spans.end(request_id, error=f"{type(e).__name__}: {e}")
            raise
        self._open_into(
            subscriber, request_id, lambda: self.receiver.admit(request_id, prompt_ids, first_token, params)
        )

    def send_write_back(
        self, request_id: str, keys: Sequence[int], reserve: Reserve, adopt: Adopt
    ) -> WriteBackResult | None:
        """Copy the KV of a finished turn (`keys`: its prompt and answer as the prefix cache hashes
        them, engine/cache_keys.py) that a prefill worker lacks into that worker's prefix cache;
        `reserve` and `adopt` call it (kv_transfer/write_back.py)."""
        self._check_open()
        return self.write_back_source.push(request_id, keys, reserve, adopt)

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        s["reservations"] = len(self.receiver.table)
        s["kv_in_place"] = self.receiver.shared is not None  # same-host senders write its cache
        s["endpoint"] = self.endpoint
        return s

    def check_integrity(self) -> None:
        self.receiver.check_integrity()  # the engine's too
        self.outboxes.check_integrity(self.loop.streaming())

    def close_role(self) -> None:
        self.outboxes.on_lost.remove(self._router_gone)
        self.server.stop(0)
        self.write_back_source.clients.close()
        if self.receiver.shared is not None:
            self.receiver.shared.close()  # a killed worker's is swept by the next to start
