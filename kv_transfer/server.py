"""gRPC server of the decode side: Reserve / Push / Release / Claim, a health service, a reaper.

The servicer is thin: it checks who may call (kv_transfer/security.py), unframes messages and
hands them to KVReceiver. Limits, all from the cache layout or config, none from the caller:

    message size   one chunk (`receiver.max_chunk_bytes`) + its header; larger: RESOURCE_EXHAUSTED
                   from gRPC before the message is buffered
    Push streams   at most `max_streams` open; each cut after `idle_s` without a message
    threads        `max_streams` + CONTROL_THREADS, so Release and health never wait behind Push
    Reserve lease  at most `max_lease_s`; the RPC needs the cluster `secret`

The reaper expires leases and cuts idle streams every REAP_S.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.errors import InvalidRequestError, NoFreeBlocksError
from kv_transfer.errors import ChunkRejected, KVTransferError
from kv_transfer.receiver import KVReceiver
from kv_transfer.security import SECRET_HEADER, KVTLSConfig, same_secret
from kv_transfer.status import status_of
from kv_transfer.streams import PushStreams
from kv_transfer.wire import unframe
from protos.gen import kv_transfer_pb2 as pb

SERVICE = "tandem.kv.KVTransfer"
CONTROL_THREADS = 8
REAP_S = 0.1


def max_message_bytes(receiver: KVReceiver) -> int:
    """One chunk and its header: the length prefix, ids of up to every block (<= 5 bytes each
    as varints) and a few short fields."""
    return receiver.max_chunk_bytes + 5 * receiver.max_blocks + 4096


class KVTransferServer:
    """`secret`: the cluster secret Reserve needs (None: Reserve is refused; decode workers
    reserve in-process). `tls`: serve TLS with these files (None: plaintext)."""

    def __init__(
        self,
        receiver: KVReceiver,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: str | None = None,
        tls: KVTLSConfig | None = None,
        max_streams: int = 64,
        idle_s: float = 10.0,
        max_lease_s: float = 60.0,
    ) -> None:
        self.receiver = receiver
        self.secret = secret
        self.max_lease_s = max_lease_s
        self.streams = PushStreams(max_streams, idle_s)
        limit = max_message_bytes(receiver)
        opts = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        pool = futures.ThreadPoolExecutor(max_workers=max_streams + CONTROL_THREADS, thread_name_prefix="kv-server")
        self._server = grpc.server(pool, options=opts)
        handlers = {
            "Reserve": grpc.unary_unary_rpc_method_handler(
                self._reserve, pb.ReserveRequest.FromString, pb.ReserveResponse.SerializeToString
            ),
            "Push": grpc.stream_unary_rpc_method_handler(self._push, None, pb.PushResult.SerializeToString),
            "Release": grpc.unary_unary_rpc_method_handler(
                self._release, pb.ReleaseRequest.FromString, pb.ReleaseResponse.SerializeToString
            ),
            "Claim": grpc.unary_unary_rpc_method_handler(
                self._claim, pb.ClaimRequest.FromString, pb.ClaimResponse.SerializeToString
            ),
        }
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        address = f"{host}:{port}"
        if tls is None:
            self.port = self._server.add_insecure_port(address)
        else:
            self.port = self._server.add_secure_port(address, tls.server_credentials())
        self.endpoint = f"{host}:{self.port}"
        receiver.endpoint = self.endpoint
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="kv-reaper", daemon=True)

    def start(self) -> KVTransferServer:
        self._server.start()
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._reaper.start()
        return self

    def stop(self, grace: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self._stop.set()
        self._server.stop(grace).wait(grace + 1)

    def _reap(self) -> None:
        while not self._stop.wait(REAP_S):
            self.receiver.expire()
            self.streams.cut_idle()

    # ---- control ----------------------------------------------------------------------------

    def _reserve(self, req: pb.ReserveRequest, ctx: grpc.ServicerContext) -> pb.ReserveResponse:
        given = dict(ctx.invocation_metadata()).get(SECRET_HEADER)
        if self.secret is None:
            ctx.abort(grpc.StatusCode.PERMISSION_DENIED, "Reserve is not served here (no cluster secret configured)")
        if not same_secret(given if isinstance(given, str) else None, self.secret):
            ctx.abort(grpc.StatusCode.PERMISSION_DENIED, "Reserve needs the cluster secret")
        lease = min(req.lease_ms / 1000 if req.lease_ms else self.receiver.lease_s, self.max_lease_s)
        try:
            return self.receiver.reserve(req.request_id, req.num_tokens, lease)
        except NoFreeBlocksError as e:
            ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"no free blocks: {e}")
        except InvalidRequestError as e:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except KVTransferError as e:
            ctx.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        raise AssertionError("unreachable")

    def _release(self, req: pb.ReleaseRequest, ctx: grpc.ServicerContext) -> pb.ReleaseResponse:
        if not req.transfer_token:  # over the wire only the token holder may release
            return pb.ReleaseResponse(released=False)
        why = req.reason or "released by peer"
        ok = self.receiver.release(req.request_id, req.transfer_token, why, writer_stopped=True)
        return pb.ReleaseResponse(released=ok)

    def _claim(self, req: pb.ClaimRequest, ctx: grpc.ServicerContext) -> pb.ClaimResponse:
        try:
            self.receiver.claim(req.request_id, req.transfer_token, req.holder)
        except ChunkRejected as e:
            ctx.abort(status_of(e), str(e))
        return pb.ClaimResponse()

    # ---- data -------------------------------------------------------------------------------

    def _push(self, messages: Iterator[Any], ctx: grpc.ServicerContext) -> pb.PushResult:
        key = self.streams.open(ctx)
        if key is None:
            ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.streams.max_streams} Push streams open already")
            raise AssertionError("unreachable")
        try:
            return self._stream(key, messages, ctx)
        finally:
            self.streams.close(key)

    def _stream(self, key: int, messages: Iterator[Any], ctx: grpc.ServicerContext) -> pb.PushResult:
        header = None
        wait, last = 0.0, time.monotonic()
        try:
            for msg in messages:
                self.streams.mark(key, busy=True)
                now = time.monotonic()
                wait += now - last
                header, inband = unframe(msg)
                if header.commit:
                    stats = self.receiver.commit(header, wait)
                    return pb.PushResult(bytes=stats.bytes, seconds=stats.seconds, chunks=stats.chunks)
                self.receiver.accept(header, inband)
                last = time.monotonic()
                self.streams.mark(key, busy=False)
        except ChunkRejected as e:
            ctx.abort(status_of(e), str(e))
        except ValueError as e:
            if header is not None:
                self.receiver.release(header.request_id, header.transfer_token, f"malformed frame: {e}")
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed frame: {e}")
        except Exception:  # the sender vanished or idled out: free its reservation now, not at lease end
            if header is not None:
                self.receiver.release(header.request_id, header.transfer_token, self._why_ended(key, "went away"))
            raise
        why = self._why_ended(key, "ended without commit")  # a cut may end the read cleanly, too
        if header is not None:
            self.receiver.release(header.request_id, header.transfer_token, why)
        ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        raise AssertionError("unreachable")

    def _why_ended(self, key: int, otherwise: str) -> str:
        if self.streams.was_cut(key):
            return f"stream idle for {self.streams.idle_s:.1f} s"
        return f"sender's stream {otherwise}"
