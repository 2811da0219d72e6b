"""The prefill side of a transfer: a client of one decode worker's KV server.

Reserve (tests and benchmarks; needs the cluster secret), push (kv_transfer/push.py: queued,
streamed in the background, never waits), release. On shm, a push into a receiver whose cache
is shared Claims its reservation first (on the opener thread) and then writes in place
(kv_transfer/in_place.py). Releases on failure paths are futures:
no caller ever waits on a Release RPC to a peer that may be gone, and if it is gone its lease
and the server's stream deadline free the blocks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import grpc

from kv_transfer.collective import CollectiveLink, CollectiveWriter
from kv_transfer.errors import PeerUnavailable
from kv_transfer.in_place import holder
from kv_transfer.in_place_writer import CACHES, InPlaceWriter
from kv_transfer.payload import InbandWriter, PayloadWriter, ShmSegmentPool, ShmWriter
from kv_transfer.push import MAX_QUEUED_BYTES, STALL_S, KVPush
from kv_transfer.security import SECRET_HEADER, KVTLSConfig
from kv_transfer.selection import Placement, here, select
from kv_transfer.server import SERVICE
from kv_transfer.status import as_transfer_error
from protos.gen import kv_transfer_pb2 as pb

__all__ = ["KVClients", "KVPush", "KVTransferClient"]


class KVTransferClient:
    """A connection to one decode worker's KV transfer server. The collective transport needs
    `link`, the sender end of a CollectiveLink to that worker; the caller owns and closes it.

    `timeout_s` bounds each unary call (Reserve, Release). `secret`: the cluster secret, for
    Reserve. `tls`: connect over TLS (None: plaintext). `stall_s`, `max_queued_bytes`: each
    push's progress deadline and queue bound (kv_transfer/push.py). `in_place`: on shm, write
    into a receiver's shared cache when it has one (False: always through segments).
    `transport="auto"` picks per transfer from where the receiver runs (kv_transfer/selection.py)."""

    def __init__(
        self,
        endpoint: str,
        transport: str = "grpc",
        timeout_s: float = 5.0,
        link: CollectiveLink | None = None,
        *,
        secret: str | None = None,
        tls: KVTLSConfig | None = None,
        stall_s: float = STALL_S,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
        in_place: bool = True,
    ) -> None:
        if transport not in ("grpc", "shm", "auto", "collective"):
            raise ValueError(f"unknown transport {transport!r}")
        if (transport == "collective") != (link is not None):
            raise ValueError("the collective transport needs a CollectiveLink, and only it takes one")
        self.endpoint = endpoint
        self.transport = transport
        self.timeout_s = timeout_s
        self.link = link
        self.stall_s = stall_s
        self.max_queued_bytes = max_queued_bytes
        self._secret = secret
        self._shm_pool = ShmSegmentPool()
        self._caches = CACHES if in_place else None
        self._lock = threading.Lock()
        self._releasing: set[grpc.Future] = set()
        self._opener = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-open")
        self._opener.submit(lambda: None)  # start its thread now, not on the engine loop's first send
        if tls is None:
            self._channel = grpc.insecure_channel(endpoint)
        else:
            self._channel = grpc.secure_channel(endpoint, tls.channel_credentials())
        self._reserve = self._channel.unary_unary(
            f"/{SERVICE}/Reserve", pb.ReserveRequest.SerializeToString, pb.ReserveResponse.FromString
        )
        self._release = self._channel.unary_unary(
            f"/{SERVICE}/Release", pb.ReleaseRequest.SerializeToString, pb.ReleaseResponse.FromString
        )
        self._push = self._channel.stream_unary(f"/{SERVICE}/Push", None, pb.PushResult.FromString)
        self._claim = self._channel.unary_unary(
            f"/{SERVICE}/Claim", pb.ClaimRequest.SerializeToString, pb.ClaimResponse.FromString
        )

    def reserve(self, request_id: str, num_tokens: int, lease_ms: int = 0) -> pb.ReserveResponse:
        """Reserve over gRPC (decode workers reserve in-process instead). Raises
        KVTransferError; ChunkRejected("permission_denied") without the right secret."""
        metadata = ((SECRET_HEADER, self._secret),) if self._secret else None
        try:
            req = pb.ReserveRequest(request_id=request_id, num_tokens=num_tokens, lease_ms=lease_ms)
            return self._reserve(req, timeout=self.timeout_s, metadata=metadata)  # type: ignore[no-any-return]
        except grpc.RpcError as e:
            raise as_transfer_error(e, f"reserve {request_id!r} on {self.endpoint}") from e

    def release(self, request_id: str, token: str, reason: str) -> bool:
        """Release and wait for the answer (at most timeout_s): whether it freed anything."""
        try:
            req = pb.ReleaseRequest(request_id=request_id, transfer_token=token, reason=reason)
            return bool(self._release(req, timeout=self.timeout_s).released)
        except (grpc.RpcError, ValueError):  # the peer is gone (or this channel closed): its lease frees the blocks
            return False

    def release_async(self, request_id: str, token: str, reason: str) -> None:
        """Release without waiting (best effort): for failure paths, where the peer may be gone."""
        req = pb.ReleaseRequest(request_id=request_id, transfer_token=token, reason=reason)
        try:
            f = self._release.future(req, timeout=self.timeout_s)
        except ValueError:  # a closed channel: the lease and the stream deadline free the blocks
            return
        with self._lock:  # gRPC cancels a call whose future is dropped: hold it until it is done
            self._releasing.add(f)
        f.add_done_callback(self._released)

    def _released(self, f: grpc.Future) -> None:
        with self._lock:
            self._releasing.discard(f)

    def open_stream(self, push: KVPush) -> None:
        """Open `push`'s stream on the opener thread, then hand it over (`push.opened`). Does not
        wait: starting a call costs milliseconds, too many for the engine loop. Raises
        PeerUnavailable if the client is closed."""
        try:
            self._opener.submit(self._open, push)
        except RuntimeError as e:
            raise PeerUnavailable(f"push to {self.endpoint}: the client is closed") from e

    def _open(self, push: KVPush) -> None:
        try:
            future = self._push.future(push.messages())
        except Exception as e:  # a closed channel
            push.open_failed(e)
            return
        push.opened(future)

    def push(
        self,
        request_id: str,
        reservation: pb.ReserveResponse,
        deadline_s: float | None = None,
        *,
        stall_s: float | None = None,
    ) -> KVPush:
        """A push into `reservation`. `stall_s` (default: the client's) is its progress deadline;
        `deadline_s` is its former name (there is no total deadline any more)."""
        kind = select(here(), Placement(reservation.node)) if self.transport == "auto" else self.transport
        writer: PayloadWriter = InbandWriter() if kind == "grpc" else ShmWriter(self._shm_pool)
        if self.link is not None:
            writer = CollectiveWriter(self.link)
        elif (
            self._caches is not None
            and isinstance(writer, ShmWriter)
            and (target := self._caches.get(reservation)) is not None
        ):
            writer = InPlaceWriter(target, self._claim_async(request_id, reservation.transfer_token), writer)
        elif self.transport == "auto":
            writer = InbandWriter()  # the receiver's cache is not reachable from here after all
        stall = stall_s or deadline_s or self.stall_s
        return KVPush(self, request_id, reservation, writer, stall, self.max_queued_bytes)

    def _claim_async(self, request_id: str, token: str) -> Future[None]:
        """Claim the reservation on the opener thread (before the push's stream opens there); the
        future fails if the receiver refuses or cannot be reached."""

        def claim() -> None:
            req = pb.ClaimRequest(request_id=request_id, transfer_token=token, holder=holder())
            self._claim(req, timeout=self.timeout_s)

        try:
            return self._opener.submit(claim)
        except RuntimeError as e:
            refused: Future[None] = Future()
            refused.set_exception(PeerUnavailable(f"claim on {self.endpoint}: the client is closed: {e}"))
            return refused

    def close(self) -> None:
        self._opener.shutdown(wait=False)
        self._channel.close()
        self._shm_pool.close()


class KVClients:
    """One KVTransferClient per peer endpoint, made on first use and kept: every transfer to a
    peer is a stream on one long-lived channel, with no per-request connection or thread setup."""

    def __init__(self, make: Callable[[str], KVTransferClient]) -> None:
        self._make = make
        self._clients: dict[str, KVTransferClient] = {}
        self._lock = threading.Lock()

    def get(self, endpoint: str) -> KVTransferClient:
        with self._lock:
            c = self._clients.get(endpoint)
            if c is None:
                c = self._clients[endpoint] = self._make(endpoint)
            return c

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
