"""gRPC status codes and the typed errors of a transfer, both ways.

    receiver: ChunkRejected.code ──REJECT_CODES──▶ status ──wire──▶ sender: as_transfer_error ──▶ typed error

Every exception the sender's transport raises (an RpcError, a cancelled or timed-out future,
an OSError from shm, anything) becomes a KVTransferError of the one push it belongs to.
"""

from __future__ import annotations

import grpc

from kv_transfer.errors import ChunkRejected, KVTransferError, PeerUnavailable, TransferAborted, TransferTimeout

REJECT_CODES = {
    "unknown_request": grpc.StatusCode.NOT_FOUND,
    "expired": grpc.StatusCode.NOT_FOUND,
    "bad_token": grpc.StatusCode.PERMISSION_DENIED,
    "bad_checksum": grpc.StatusCode.DATA_LOSS,
    "too_large": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "incomplete": grpc.StatusCode.FAILED_PRECONDITION,
    "complete": grpc.StatusCode.FAILED_PRECONDITION,
}


def status_of(e: ChunkRejected) -> grpc.StatusCode:
    return REJECT_CODES.get(e.code, grpc.StatusCode.INVALID_ARGUMENT)


def as_transfer_error(e: BaseException, what: str) -> KVTransferError:
    """The typed error for `e`, raised while doing `what`."""
    if isinstance(e, KVTransferError):
        return e
    if isinstance(e, grpc.RpcError):
        return _of_status(e, what)
    if isinstance(e, grpc.FutureCancelledError):
        return TransferAborted(f"{what}: the stream was cancelled")
    if isinstance(e, grpc.FutureTimeoutError):
        return TransferTimeout(f"{what}: timed out")
    return TransferAborted(f"{what}: {type(e).__name__}: {e}")


def _of_status(e: grpc.RpcError, what: str) -> KVTransferError:
    code = e.code() if hasattr(e, "code") else None
    detail = e.details() if hasattr(e, "details") else str(e)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TransferTimeout(f"{what}: deadline exceeded")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
        return PeerUnavailable(f"{what}: {detail}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return KVTransferError(f"{what}: the receiver is out of room: {detail}")
    return ChunkRejected(code.name.lower() if code else "error", f"{what}: {detail}")
