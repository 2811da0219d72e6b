"""The prefill side of a transfer: reserve, push chunks in the background, commit or abort.

`KVPush.send` only queues; a gRPC thread drains the queue into the Push stream, so the
network works while prefill computes the next layers. Every wait has a deadline, and
every failure surfaces as a typed error (TransferTimeout, PeerUnavailable, ChunkRejected).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence

import grpc
import torch

from kv_transfer.collective import CollectiveLink, CollectiveWriter
from kv_transfer.errors import ChunkRejected, KVTransferError, PeerUnavailable, TransferTimeout
from kv_transfer.payload import InbandWriter, PayloadWriter, ShmSegmentPool, ShmWriter
from kv_transfer.server import MAX_MESSAGE, SERVICE
from kv_transfer.stats import TransferStats
from kv_transfer.wire import DTYPE_NAMES, checksum, frame, tensor_bytes
from protos.gen import kv_transfer_pb2 as pb

_DONE = object()


def _typed(e: grpc.RpcError, what: str) -> KVTransferError:
    code = e.code() if hasattr(e, "code") else None
    detail = e.details() if hasattr(e, "details") else str(e)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TransferTimeout(f"{what}: deadline exceeded")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
        return PeerUnavailable(f"{what}: {detail}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return KVTransferError(f"{what}: receiver has no free blocks: {detail}")
    return ChunkRejected(code.name.lower() if code else "error", f"{what}: {detail}")


class KVTransferClient:
    """A connection to one decode worker's KV transfer server. The collective transport needs
    `link`, the sender end of a CollectiveLink to that worker; the caller owns and closes it."""

    def __init__(
        self, endpoint: str, transport: str = "grpc", timeout_s: float = 5.0, link: CollectiveLink | None = None
    ) -> None:
        if transport not in ("grpc", "shm", "collective"):
            raise ValueError(f"unknown transport {transport!r}")
        if (transport == "collective") != (link is not None):
            raise ValueError("the collective transport needs a CollectiveLink, and only it takes one")
        self.endpoint = endpoint
        self.transport = transport
        self.timeout_s = timeout_s
        self.link = link
        self._shm_pool = ShmSegmentPool()
        opts = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
        self._channel = grpc.insecure_channel(endpoint, options=opts)
        self._reserve = self._channel.unary_unary(
            f"/{SERVICE}/Reserve", pb.ReserveRequest.SerializeToString, pb.ReserveResponse.FromString
        )
        self._release = self._channel.unary_unary(
            f"/{SERVICE}/Release", pb.ReleaseRequest.SerializeToString, pb.ReleaseResponse.FromString
        )
        self._push = self._channel.stream_unary(f"/{SERVICE}/Push", None, pb.PushResult.FromString)

    def reserve(self, request_id: str, num_tokens: int, lease_ms: int = 0) -> pb.ReserveResponse:
        try:
            req = pb.ReserveRequest(request_id=request_id, num_tokens=num_tokens, lease_ms=lease_ms)
            return self._reserve(req, timeout=self.timeout_s)  # type: ignore[no-any-return]
        except grpc.RpcError as e:
            raise _typed(e, f"reserve {request_id!r} on {self.endpoint}") from e

    def release(self, request_id: str, token: str, reason: str) -> bool:
        try:
            req = pb.ReleaseRequest(request_id=request_id, transfer_token=token, reason=reason)
            return bool(self._release(req, timeout=self.timeout_s).released)
        except grpc.RpcError:
            return False  # the peer is gone; its lease frees the blocks

    def push(self, request_id: str, reservation: pb.ReserveResponse, deadline_s: float | None = None) -> KVPush:
        writer: PayloadWriter = InbandWriter() if self.transport == "grpc" else ShmWriter(self._shm_pool)
        if self.link is not None:
            writer = CollectiveWriter(self.link)
        return KVPush(self, request_id, reservation, writer, deadline_s or self.timeout_s * 2)

    def close(self) -> None:
        self._channel.close()
        self._shm_pool.close()


class KVPush:
    """One request's stream of chunks. Not thread-safe: one producer (the prefill loop)."""

    def __init__(
        self,
        client: KVTransferClient,
        request_id: str,
        reservation: pb.ReserveResponse,
        writer: PayloadWriter,
        deadline_s: float,
    ) -> None:
        self.client = client
        self.request_id = request_id
        self.reservation = reservation
        self.writer = writer
        self.deadline = time.monotonic() + deadline_s
        self.bytes = 0
        self.chunks = 0
        self.queue_wait_s = 0.0
        self.started = time.monotonic()
        self._q: queue.Queue[object] = queue.Queue(maxsize=32)
        self._closed = threading.Event()
        self._future = client._push.future(self._messages(), timeout=deadline_s)

    def _messages(self) -> Iterator[bytes]:
        while not self._closed.is_set():
            try:
                item = self._q.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is _DONE:
                return
            assert isinstance(item, bytes)
            yield item

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.abort("deadline passed")
            raise TransferTimeout(f"transfer of {self.request_id!r} passed its deadline")
        return left

    def _put(self, item: object) -> None:
        t = time.monotonic()
        while True:
            if self._future.done():
                self._fail()
            try:
                self._q.put(item, timeout=min(0.05, self._left()))
                break
            except queue.Full:
                continue
        self.queue_wait_s += time.monotonic() - t

    def _fail(self) -> None:
        exc = self._future.exception()
        self.abort("stream failed")
        if isinstance(exc, grpc.RpcError):
            raise _typed(exc, f"push {self.request_id!r} to {self.client.endpoint}") from exc
        raise PeerUnavailable(f"push {self.request_id!r} ended early: {exc}")

    def send(self, layer_start: int, layer_end: int, logical_blocks: Sequence[int], data: torch.Tensor) -> None:
        """Queue KV of layers [layer_start, layer_end) for the request's logical blocks.

        data: [layers, 2, len(logical_blocks), block_size, kv_heads, head_dim], contiguous."""
        dst = [self.reservation.block_ids[j] for j in logical_blocks]
        header = pb.KVChunkHeader(
            request_id=self.request_id,
            transfer_token=self.reservation.transfer_token,
            layer_start=layer_start,
            layer_end=layer_end,
            block_ids=dst,
            dtype=DTYPE_NAMES[data.dtype],
            shape=list(data.shape),
            payload_bytes=data.numel() * data.element_size(),
        )
        raw = tensor_bytes(data)
        header.checksum = checksum(raw)
        try:
            inband = self.writer.put(header, data)
        except KVTransferError:
            self.abort("payload transport failed")
            raise
        self._put(frame(header, inband))
        self.bytes += header.payload_bytes
        self.chunks += 1

    def commit(self, num_tokens: int) -> TransferStats:
        """Send the commit and wait for the receiver's verdict; returns the sender's figures.

        Raises TransferTimeout, PeerUnavailable or ChunkRejected."""
        header = pb.KVChunkHeader(
            request_id=self.request_id,
            transfer_token=self.reservation.transfer_token,
            commit=True,
            num_tokens=num_tokens,
        )
        try:
            self._put(frame(header))
            self._put(_DONE)
            t = time.monotonic()
            self._future.result(timeout=self._left())
            self.writer.settle()  # the receiver read every payload
            done = time.monotonic()
            self.queue_wait_s += done - t
            return TransferStats(self.request_id, self.bytes, self.chunks, done - self.started, self.queue_wait_s)
        except grpc.RpcError as e:
            raise _typed(e, f"commit {self.request_id!r}") from e
        except grpc.FutureTimeoutError as e:
            self.abort("commit timed out")
            raise TransferTimeout(f"commit of {self.request_id!r} timed out") from e
        finally:
            self._closed.set()
            self.writer.close()

    def abort(self, reason: str) -> None:
        """Stop the stream and tell the receiver to free the reservation (best effort)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._future.cancel()
        self.client.release(self.request_id, self.reservation.transfer_token, reason)
        self.writer.close()
