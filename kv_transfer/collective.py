"""The collective transport: payloads over torch.distributed point-to-point, control over gRPC.

A CollectiveLink is a process group of two, built standalone from a TCPStore (no
init_process_group, so no global state: a process may hold several links): rank 0 is the
prefill side and only sends, rank 1 the decode side and only receives. The backend is
config: "nccl" between GPUs, "gloo" on CPU; the code path is the same.

NCCL ignores tags and pairs sends with receives in the order they are posted, while Push
streams of concurrent requests reach the receiver in any order. So a link is one ordered
stream: under a lock each payload takes the next sequence number and goes out as two
messages, [seq, nbytes] then the bytes, and its header carries the seq:

    sender    put(h_a) -> seq 0:  [0, n0] bytes0 ─┐
              put(h_b) -> seq 1:  [1, n1] bytes1 ─┤  one FIFO per link
                                                  ▼
    receiver  accept(h_b, seq 1): reads seq 0 into the stash, then seq 1 -> h_b's payload
              accept(h_a, seq 0): seq 0 from the stash

The receiver reads the stream in order up to the seq its header names. A send is posted
before its header is queued, so a receive never waits for bytes that were not sent unless
the peer died or stalled. A payload whose header never arrives (a chunk rejected before its
payload was read, an aborted push) is read through by a later header and dropped from the
stash after `timeout_s`.

A gloo wait that times out closes the connection for good, so the sender only waits on
sends it knows were read: `settle(seq)` after a commit succeeded (the receiver read every
payload up to that one, and the stream is FIFO). Any failure (the peer died, a wait timed
out, the stream lost its order) breaks the link: PeerUnavailable or TransferTimeout, then
PeerUnavailable on every later use. Connect a new link to recover.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, cast

import torch
import torch.distributed as dist

from kv_transfer.errors import KVTransferError, PeerUnavailable, TransferTimeout
from kv_transfer.wire import tensor_bytes
from protos.gen import kv_transfer_pb2 as pb

SENDER, RECEIVER = 0, 1
_TAG = 0  # order, not tags, pairs the messages (NCCL has no tags)


@dataclass(frozen=True)
class LinkConfig:
    port: int  # the TCPStore's; rank 0 hosts it
    host: str = "127.0.0.1"
    backend: str = "gloo"  # "nccl" between GPUs (this process's current CUDA device)
    timeout_s: float = 10.0  # rendezvous and every wait

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown collective backend {self.backend!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"bad port {self.port}")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)


class _P2P(Protocol):
    """What a link uses of a process group (torch's stubs declare send/recv on ProcessGroup only)."""

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> dist.Work: ...
    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> dist.Work: ...
    def abort(self) -> None: ...


@dataclass
class _Sent:
    seq: int
    works: list[dist.Work]
    tensors: tuple[torch.Tensor, ...]  # alive until the send completes


class CollectiveLink:
    """One sender and one receiver over a two-rank process group. Thread-safe."""

    def __init__(self, pg: _P2P, store: object, rank: int, device: torch.device, timeout_s: float) -> None:
        self.rank = rank
        self.device = device
        self.timeout_s = timeout_s
        self._pg = pg
        self._store = store  # rank 0 serves it; NCCL may still use it after the handshake
        self._lock = threading.Lock()
        self._next = 0  # sender: seq of the next send; receiver: seq of the next read
        self._inflight: deque[_Sent] = deque()
        self._stash: dict[int, tuple[torch.Tensor, float]] = {}
        self._broken = ""

    @classmethod
    def connect(cls, config: LinkConfig, rank: int) -> CollectiveLink:
        """Rendezvous with the peer, which calls this with the other rank. Each step (store,
        process group, handshake) waits at most config.timeout_s; raises PeerUnavailable if the
        peer does not come, TransferTimeout if it stalls."""
        if rank not in (SENDER, RECEIVER):
            raise ValueError(f"rank must be {SENDER} (sender) or {RECEIVER} (receiver), not {rank}")
        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                config.host, config.port, 2, rank == SENDER, timeout=config.timeout, wait_for_workers=False
            )
            if config.backend == "gloo":
                pg = cast(_P2P, dist.ProcessGroupGloo(store, rank, 2, config.timeout))
                device = torch.device("cpu")
            else:
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = config.timeout
                pg = cast(_P2P, dist.ProcessGroupNCCL(store, rank, 2, opts))
                device = torch.device("cuda", torch.cuda.current_device())
        except RuntimeError as e:
            raise PeerUnavailable(f"collective link to {config.host}:{config.port} as rank {rank}: {e}") from e
        link = cls(pg, store, rank, device, config.timeout_s)
        link._handshake()
        return link

    def _handshake(self) -> None:
        # NCCL connects lazily: one round trip here, so the first payload does not pay for it
        hello = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.rank == SENDER:
            self._wait(self._post(self._pg.send, hello), "handshake")
        else:
            self._wait(self._post(self._pg.recv, hello), "handshake")

    # ---- sender -----------------------------------------------------------------------------

    def send(self, data: torch.Tensor) -> int:
        """Post `data`'s bytes as the next payload and return its seq; does not wait. On CPU the
        link reads `data` itself until the send completes: the caller must not write to it (the
        streamer sends copies). Raises PeerUnavailable if the link is broken."""
        self._need(SENDER)
        payload = data.contiguous().reshape(-1).view(torch.uint8).to(self.device)
        with self._lock:
            self._check()
            seq = self._next
            meta = torch.tensor([seq, payload.numel()], dtype=torch.int64, device=self.device)
            works = [self._post(self._pg.send, meta), self._post(self._pg.send, payload)]
            self._inflight.append(_Sent(seq, works, (meta, payload)))
            self._next += 1
            return seq

    def settle(self, seq: int) -> None:
        """Complete every send up to `seq`; call only once the receiver has read payload `seq`."""
        self._need(SENDER)
        with self._lock:
            while self._inflight and self._inflight[0].seq <= seq:
                for w in self._inflight.popleft().works:
                    self._wait(w, "send")

    @property
    def num_inflight(self) -> int:
        """Sends not yet settled (an aborted push's stay until a later commit settles past them)."""
        return len(self._inflight)

    # ---- receiver ---------------------------------------------------------------------------

    def recv(self, seq: int) -> torch.Tensor:
        """Payload `seq` as a CPU uint8 tensor. Reads the stream in order up to `seq`, stashing
        payloads that came before their headers. Raises ValueError if `seq` was taken already or
        expired; PeerUnavailable or TransferTimeout if the link fails."""
        self._need(RECEIVER)
        with self._lock:
            self._check()
            while self._next <= seq:
                self._stash[self._next] = (self._read(self._next), time.monotonic())
                self._next += 1
            got = self._stash.pop(seq, None)
            stale = time.monotonic() - self.timeout_s
            for s in [s for s, (_, t) in self._stash.items() if t < stale]:
                del self._stash[s]
        if got is None:
            raise ValueError(f"no payload {seq} on the collective link (read already, or expired)")
        return got[0]

    def _read(self, seq: int) -> torch.Tensor:
        meta = torch.empty(2, dtype=torch.int64, device=self.device)
        self._wait(self._post(self._pg.recv, meta), "recv")
        got, nbytes = meta.tolist()
        if got != seq:
            self._broken = f"stream out of order: payload {got} where {seq} was due"
            raise PeerUnavailable(f"collective link {self._broken}")
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._wait(self._post(self._pg.recv, buf), "recv")
        return buf.cpu()  # the receiver checksums and writes from host memory

    # ---- both -------------------------------------------------------------------------------

    def _post(self, op: Callable[[list[torch.Tensor], int, int], dist.Work], t: torch.Tensor) -> dist.Work:
        try:
            return op([t], 1 - self.rank, _TAG)
        except RuntimeError as e:
            raise self._fail(e, "post") from e

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            if self.device.type == "cpu":
                work.wait(timedelta(seconds=self.timeout_s))  # gloo: blocks the host, bounded
            else:
                # NCCL's wait() only orders streams: poll the op's event against our own deadline
                deadline = time.monotonic() + self.timeout_s
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{what} timed out after {self.timeout_s:.1f} s")
                    time.sleep(1e-4)
                work.wait()
        except RuntimeError as e:
            raise self._fail(e, what) from e

    def _fail(self, e: RuntimeError, what: str) -> KVTransferError:
        self._broken = f"{what} failed: {e}"
        if self.device.type == "cuda":
            self._pg.abort()  # free the communicator; the op will never complete
        kind = TransferTimeout if "timed out" in str(e).lower() else PeerUnavailable
        return kind(f"collective link {self._broken}")

    def _check(self) -> None:
        if self._broken:
            raise PeerUnavailable(f"collective link is broken ({self._broken}); connect a new one")

    def _need(self, rank: int) -> None:
        if self.rank != rank:
            raise ValueError(f"only rank {rank} may do that on a collective link; this is rank {self.rank}")

    def close(self) -> None:
        """Stop using the link; unsettled sends are dropped. Later use raises PeerUnavailable."""
        with self._lock:
            if not self._broken and self.device.type == "cuda":
                self._pg.abort()
            self._broken = self._broken or "closed"
            self._inflight.clear()
            self._stash.clear()


class CollectiveWriter:
    """PayloadWriter of one push: posts payloads on the link; `settle` after a good commit."""

    def __init__(self, link: CollectiveLink) -> None:
        self.link = link
        self._last = -1

    def put(self, header: pb.KVChunkHeader, data: torch.Tensor) -> memoryview:
        header.transport = "collective"
        header.collective_seq = self._last = self.link.send(data)
        return memoryview(b"")

    def settle(self) -> None:
        """The push committed, so the receiver read all its payloads: complete their sends."""
        if self._last >= 0:
            self.link.settle(self._last)

    def close(self) -> None:
        pass  # unsettled sends stay with the link until a later commit settles past them


class CollectiveReader:
    """PayloadReader of the decode side: `KVReceiver.readers["collective"] = CollectiveReader(link)`."""

    def __init__(self, link: CollectiveLink) -> None:
        self.link = link

    def get(self, header: pb.KVChunkHeader, inband: memoryview) -> memoryview:
        if len(inband):
            raise ValueError("a collective chunk carries no in-band bytes")
        return tensor_bytes(self.link.recv(header.collective_seq))

    def close(self) -> None:
        pass  # the link belongs to whoever connected it
