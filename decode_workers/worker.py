"""DecodeWorker: reserves blocks, receives KV over kv_transfer, decodes in continuous batches.

Tokens go back as a Ray streaming generator (`generate` is a plain generator; the actor
wrapper declares it streaming): Ray then carries backpressure and actor death to the
caller, who sees a typed error on the next item, with no second port or protocol to run.
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
from kv_transfer.server import KVTransferServer


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
    ) -> None:
        """`tls`: serve the KV endpoint over TLS (mutual with a CA file); None: plaintext."""
        super().__init__(worker_id, model_path, config)
        self.receiver = KVReceiver(self.engine, self.loop.lock, lease_s=lease_s)
        self.server = KVTransferServer(self.receiver, host=host, tls=tls).start()
        self.endpoint = self.server.endpoint

    def reserve(self, request_id: str, num_tokens: int, lease_s: float | None = None) -> bytes:
        """Claim blocks for a prompt's KV; a serialized ReserveResponse (endpoint, token, blocks).
        `lease_s`: how long they wait for the first chunk (default: the receiver's lease)."""
        self._check_open()
        return bytes(self.receiver.reserve(request_id, num_tokens, lease_s).SerializeToString())

    def release(self, request_id: str) -> bool:
        return self.receiver.release(request_id, None, "released by caller")

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

    def generate_local(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, step_timeout_s: float = 30.0
    ) -> Iterator[TokenOutput]:
        """The local route: run a request whole here, prefilling only what this engine's prefix
        cache lacks (a conversation's next turn, whose history and last answer this worker wrote),
        then decoding. Outputs as `generate`'s; the first carries `num_cached_tokens`."""
        yield from self._run_whole(request_id, prompt_ids, params, step_timeout_s)

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        s["reservations"] = len(self.receiver.table)
        s["endpoint"] = self.endpoint
        return s

    def check_integrity(self) -> None:
        self.receiver.check_integrity()

    def shutdown(self) -> None:
        self.server.stop(0)
        super().shutdown()
