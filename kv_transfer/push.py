"""One request's stream of chunks to a decode worker. Its producer (the engine loop) never waits.

`send` frames a chunk and queues it; a gRPC thread drains the queue into the Push stream
(opened by the first message, so a request waiting in the prefill queue holds no stream).
`send` neither blocks nor raises: whatever goes wrong fails this one transfer, keeps its
typed error, cancels the stream and releases the reservation in the background; `commit`
raises the error. Other transfers, and the engine step, go on.

    open ──send*──▶ commit ──answer──▶ done
      \\______________\\____ stall / queue full / stream error / exception / abort ──▶ failed

Deadlines follow progress, not a total (a long prompt is not a slow receiver):

    stall     the receiver took nothing for `stall_s` while something waited for it
    queue     more than `max_queued_bytes` waiting: the receiver is far slower than prefill
    commit    the answer takes longer than stall_s + (bytes still queued) / MIN_BYTES_PER_S
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import grpc
import torch

from kv_transfer.chunk_writer import InPlaceHeaders, chunk_header, write_chunk
from kv_transfer.errors import KVTransferError, TransferAborted, TransferTimeout
from kv_transfer.payload import PayloadWriter
from kv_transfer.stats import TransferStats
from kv_transfer.status import as_transfer_error
from kv_transfer.wire import chunk_spans, frame, split
from protos.gen import kv_transfer_pb2 as pb

if TYPE_CHECKING:
    from kv_transfer.sender import KVTransferClient

STALL_S = 5.0
MAX_QUEUED_BYTES = 256 << 20
MIN_BYTES_PER_S = 20e6  # well under loopback or any data-centre link: a bound, not an estimate
_POLL_S = 0.05


class KVPush:
    """One request's transfer. `send` comes from one producer (the engine loop); `commit`,
    `abort` and `error` may come from other threads."""

    def __init__(
        self,
        client: KVTransferClient,
        request_id: str,
        reservation: pb.ReserveResponse,
        writer: PayloadWriter,
        stall_s: float = STALL_S,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
    ) -> None:
        if stall_s <= 0 or max_queued_bytes <= 0:
            raise ValueError("stall_s and max_queued_bytes must be positive")
        self.client = client
        self.request_id = request_id
        self.reservation = reservation
        self.writer = writer
        self.stall_s = stall_s
        self.max_queued_bytes = max_queued_bytes
        self.bytes = 0
        self.chunks = 0
        self.queue_wait_s = 0.0
        self.started = time.monotonic()
        self._cv = threading.Condition()
        self._queue: deque[bytes | None] = deque()  # None: the end of the stream
        self._queued_bytes = 0
        self._progress = self.started  # when the receiver last took a message, or one began to wait
        self._future: grpc.Future | None = None
        self._opening = False
        self._ending = False  # commit queued: no more sends; the stream's end is the answer
        self._done = False
        self._error: KVTransferError | None = None
        self._writer_lock = threading.Lock()  # a payload is never written into a segment given back
        self._in_place = InPlaceHeaders()  # the producer's alone

    # ---- state ------------------------------------------------------------------------------

    @property
    def error(self) -> KVTransferError | None:
        """Why this transfer failed, or None while it is healthy. Checks the stall deadline."""
        with self._cv:
            err = self._error or self._overdue()
        if err is not None and self._error is None:
            self._fail(err)
        return self._error

    def _overdue(self) -> KVTransferError | None:
        """Caller holds the lock. A deadline passed or the stream ended before its commit."""
        if self._queue and time.monotonic() - self._progress > self.stall_s:
            return TransferTimeout(f"push {self.request_id!r}: the receiver took nothing for {self.stall_s:.1f} s")
        f = self._future
        if f is not None and f.done() and not self._ending:
            try:
                cause: BaseException | None = f.exception()
            except BaseException as e:  # a cancelled future raises instead of returning
                cause = e
            return as_transfer_error(cause or RuntimeError("stream ended early"), f"push {self.request_id!r}")
        return None

    def _fail(self, err: KVTransferError) -> KVTransferError:
        """Fail the transfer with `err` unless it already ended; returns the error it keeps.
        Never waits on the network: the stream is cancelled and the release is a future."""
        with self._cv:
            if self._done or self._error is not None:
                return self._error or err
            self._error = err
            self._queue.clear()
            self._queued_bytes = 0
            self._cv.notify_all()
            future = self._future
        if future is not None:
            future.cancel()
        with self._writer_lock:  # first: an in-place sender's Release says it writes no more
            self.writer.close()
        self.client.release_async(self.request_id, self.reservation.transfer_token, str(err))
        return err

    def abort(self, reason: str) -> None:
        """Stop the transfer and have the receiver free the reservation. Returns at once; a
        no-op once the transfer committed or failed."""
        self._fail(TransferAborted(f"push {self.request_id!r} aborted: {reason}"))

    # ---- producer ---------------------------------------------------------------------------

    def send(self, layer_start: int, layer_end: int, logical_blocks: Sequence[int], data: torch.Tensor) -> None:
        """Queue KV of layers [layer_start, layer_end) for the request's logical blocks, as
        several chunks if it is over the receiver's max_chunk_bytes. Never blocks, never raises:
        a failure fails this transfer (see `error`) and later sends do nothing.

        data: [layer_end - layer_start, 2, len(logical_blocks), block_size, kv_heads, head_dim]."""
        if self._error is not None or self._ending:
            return
        try:
            if data.shape[0] != layer_end - layer_start:
                raise ValueError(f"data holds {data.shape[0]} layers, not [{layer_start}, {layer_end})")
            dst = [self.reservation.block_ids[j] for j in logical_blocks]
            for lo, blocks, part in split(data, dst, self.reservation.max_chunk_bytes):
                self._send(self._frame(layer_start + lo, blocks, part))
        except Exception as e:
            self._fail(as_transfer_error(e, f"send of {self.request_id!r}"))

    def send_blocks(
        self, layer_start: int, layer_end: int, logical_blocks: Sequence[int], kv: torch.Tensor, src: torch.Tensor
    ) -> None:
        """`send` of blocks still in the paged cache, copied once: on shm into the receiver's own
        blocks (in place) or straight into shared memory, where `send` copies the caller's gather
        again. Never blocks, never raises, as `send`.

        kv: [layer_end - layer_start, 2, num_blocks, block_size, kv_heads, head_dim], the cache's
        layers; src: [len(logical_blocks)] int64, the physical block of each logical block."""
        if self._error is not None or self._ending:
            return
        try:
            if kv.shape[0] != layer_end - layer_start or src.shape != (len(logical_blocks),):
                raise ValueError(
                    f"kv holds {kv.shape[0]} layers and src {tuple(src.shape)} blocks, not [{layer_start}, "
                    f"{layer_end}) and {len(logical_blocks)}"
                )
            dst = [self.reservation.block_ids[j] for j in logical_blocks]
            layer_block_bytes = kv[:1, :, :1].numel() * kv.element_size()
            for ls, bs in chunk_spans(kv.shape[0], len(dst), layer_block_bytes, self.reservation.max_chunk_bytes):
                self._send(self._frame(layer_start + ls.start, dst[bs], kv[ls], src[bs]))
        except Exception as e:
            self._fail(as_transfer_error(e, f"send of {self.request_id!r}"))

    def send_frame(self, message: bytes) -> None:
        """Queue a message already framed (kv_transfer/wire.py) as is: no split, no checks. For
        tests and tools that speak the wire format themselves; fails like `send`, never raises."""
        if self._error is not None or self._ending:
            return
        try:
            self._enqueue(message)
        except Exception as e:
            self._fail(as_transfer_error(e, f"send of {self.request_id!r}"))

    def _send(self, messages: list[bytes]) -> None:
        for m in messages:
            self._enqueue(m)

    def _frame(
        self, layer_start: int, blocks: list[int], data: torch.Tensor, src: torch.Tensor | None = None
    ) -> list[bytes]:
        """One chunk written the transport's way (chunk_writer.py): `data` itself, or (with `src`)
        its blocks `src`, [layers, 2, len(src), block_size, kv_heads, head_dim]. Returns the
        messages to send now: its own, or (in place) held headers whose layers it no longer joins."""
        header = chunk_header(self.request_id, self.reservation.transfer_token, layer_start, blocks, data, src)
        with self._writer_lock:  # the writer is not closed under it (a segment given back, a claim lifted)
            if self._error is not None:
                raise self._error
            inband = write_chunk(self.writer, header, data, src)
        self.bytes += header.payload_bytes
        self.chunks += 1
        if inband is None:
            return [frame(h) for h in self._in_place.add(header)]
        return [*(frame(h) for h in self._in_place.flush()), frame(header, inband)]

    def _enqueue(self, item: bytes | None) -> None:
        """Queue a message, opening the stream with the first. Raises the transfer's error, or
        TransferTimeout if the queue is stalled or full (the commit's messages are always taken)."""
        with self._cv:
            err = self._error or self._overdue()
            if err is not None:
                raise err
            n = len(item) if item is not None else 0
            if not self._ending and self._queued_bytes + n > self.max_queued_bytes:
                raise TransferTimeout(
                    f"push {self.request_id!r}: {self._queued_bytes} bytes already queued; the receiver is too slow"
                )
            if not self._queue:
                self._progress = time.monotonic()
            self._queue.append(item)
            self._queued_bytes += n
            self._cv.notify()
            if not self._opening:
                self._opening = True
                self.client.open_stream(self)  # on the client's opener thread: opening takes milliseconds

    def opened(self, future: grpc.Future) -> None:
        """The client opened this push's stream (reading `messages()` on gRPC's own thread)."""
        with self._cv:
            self._future = future
            failed = self._error is not None
            self._cv.notify_all()
        if failed:  # aborted while it opened
            future.cancel()

    def open_failed(self, e: BaseException) -> None:
        self._fail(as_transfer_error(e, f"opening the push of {self.request_id!r}"))

    def messages(self) -> Iterator[bytes]:
        """The Push stream's messages, read on gRPC's thread. Taking one means the last was sent."""
        while True:
            with self._cv:
                while not self._queue and self._error is None:
                    self._cv.wait(_POLL_S)
                    if self._future is not None and self._future.done():
                        return
                if self._error is not None:
                    return
                item = self._queue.popleft()
                self._queued_bytes -= len(item) if item is not None else 0
                self._progress = time.monotonic()
            if item is None:
                return
            yield item

    # ---- commit -----------------------------------------------------------------------------

    def commit(self, num_tokens: int) -> TransferStats:
        """Send the commit and wait for the receiver's verdict; returns the sender's figures.

        Raises the transfer's typed error: TransferTimeout, PeerUnavailable, ChunkRejected,
        TransferAborted (the reservation is released in the background)."""
        t = time.monotonic()
        token = self.reservation.transfer_token
        header = pb.KVChunkHeader(request_id=self.request_id, transfer_token=token, commit=True, num_tokens=num_tokens)
        try:
            with self._cv:
                if self._error is not None:
                    raise self._error
                deadline = t + self.stall_s + self._queued_bytes / MIN_BYTES_PER_S
            self._send([frame(h) for h in self._in_place.flush()])
            with self._cv:
                self._ending = True
            self._enqueue(frame(header))
            self._enqueue(None)
            self._answer(deadline)
            with self._cv:
                self._done = True  # committed: from here on nothing releases the reservation
            with self._writer_lock:
                self.writer.settle()  # the receiver read every payload
        except Exception as e:
            err = self._fail(as_transfer_error(e, f"commit of {self.request_id!r}"))
            if err is e:
                raise
            raise err from e
        with self._writer_lock:
            self.writer.close()
        done = time.monotonic()
        self.queue_wait_s += done - t
        return TransferStats(self.request_id, self.bytes, self.chunks, done - self.started, self.queue_wait_s)

    def _answer(self, deadline: float) -> pb.PushResult:
        while True:
            f = self._future
            try:
                if f is not None:
                    result: pb.PushResult = f.result(timeout=_POLL_S)
                    return result
            except grpc.FutureTimeoutError:
                pass
            with self._cv:
                if self._future is None:  # still opening
                    self._cv.wait(_POLL_S)
                err = self._error or self._overdue()
            if err is not None:
                raise err
            if time.monotonic() > deadline:
                raise TransferTimeout(f"commit of {self.request_id!r}: no answer by its deadline")
