"""gRPC server of the decode side: Reserve / Push / Release, a health service, a lease reaper.

The servicer is thin: it unframes messages and hands them to KVReceiver.
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
from kv_transfer.wire import unframe
from protos.gen import kv_transfer_pb2 as pb

SERVICE = "tandem.kv.KVTransfer"
MAX_MESSAGE = 1 << 30
_CODES = {
    "unknown_request": grpc.StatusCode.NOT_FOUND,
    "expired": grpc.StatusCode.NOT_FOUND,
    "bad_token": grpc.StatusCode.PERMISSION_DENIED,
    "bad_checksum": grpc.StatusCode.DATA_LOSS,
    "incomplete": grpc.StatusCode.FAILED_PRECONDITION,
    "complete": grpc.StatusCode.FAILED_PRECONDITION,
}


class KVTransferServer:
    def __init__(self, receiver: KVReceiver, host: str = "127.0.0.1", port: int = 0, max_workers: int = 32) -> None:
        self.receiver = receiver
        opts = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=opts)
        handlers = {
            "Reserve": grpc.unary_unary_rpc_method_handler(
                self._reserve, pb.ReserveRequest.FromString, pb.ReserveResponse.SerializeToString
            ),
            "Push": grpc.stream_unary_rpc_method_handler(self._push, None, pb.PushResult.SerializeToString),
            "Release": grpc.unary_unary_rpc_method_handler(
                self._release, pb.ReleaseRequest.FromString, pb.ReleaseResponse.SerializeToString
            ),
        }
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        self.endpoint = f"{host}:{self.port}"
        receiver.endpoint = self.endpoint
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="kv-lease-reaper", daemon=True)

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
        while not self._stop.wait(0.1):
            self.receiver.expire()

    def _reserve(self, req: pb.ReserveRequest, ctx: grpc.ServicerContext) -> pb.ReserveResponse:
        try:
            return self.receiver.reserve(req.request_id, req.num_tokens, req.lease_ms / 1000 if req.lease_ms else None)
        except NoFreeBlocksError as e:
            ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except InvalidRequestError as e:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except KVTransferError as e:
            ctx.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        raise AssertionError("unreachable")

    def _release(self, req: pb.ReleaseRequest, ctx: grpc.ServicerContext) -> pb.ReleaseResponse:
        ok = self.receiver.release(req.request_id, req.transfer_token, req.reason or "released by peer")
        return pb.ReleaseResponse(released=ok)

    def _push(self, messages: Iterator[Any], ctx: grpc.ServicerContext) -> pb.PushResult:
        header = None
        wait, last = 0.0, time.monotonic()
        try:
            for msg in messages:
                now = time.monotonic()
                wait += now - last
                header, inband = unframe(msg)
                if header.commit:
                    stats = self.receiver.commit(header, wait)
                    return pb.PushResult(bytes=stats.bytes, seconds=stats.seconds, chunks=stats.chunks)
                self.receiver.accept(header, inband)
                last = time.monotonic()
        except ChunkRejected as e:
            ctx.abort(_CODES.get(e.code, grpc.StatusCode.INVALID_ARGUMENT), str(e))
        except ValueError as e:
            if header is not None:
                self.receiver.release(header.request_id, header.transfer_token, f"malformed frame: {e}")
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed frame: {e}")
        except Exception:  # the sender vanished mid-stream: free its reservation now, not at lease end
            if header is not None:
                self.receiver.release(header.request_id, header.transfer_token, "sender went away mid-stream")
            raise
        if header is not None:
            self.receiver.release(header.request_id, header.transfer_token, "stream ended without commit")
        ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, "stream ended without commit")
        raise AssertionError("unreachable")
