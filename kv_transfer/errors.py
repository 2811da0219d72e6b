"""Typed transfer errors: what each side sees when the other misbehaves or vanishes."""

from __future__ import annotations

from engine.errors import EngineError


class KVTransferError(EngineError):
    """A KV transfer failed; the request's blocks have been (or are being) freed on this side."""


class ChunkRejected(KVTransferError):
    """The receiver refused a chunk and wrote nothing. `code` says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.detail = message

    def __reduce__(self) -> tuple[type[ChunkRejected], tuple[str, str]]:
        return type(self), (self.code, self.detail)  # crosses Ray (pickle): two arguments, not one


class TransferTimeout(KVTransferError):
    """A deadline passed: the peer stalled or the lease expired."""


class PeerUnavailable(KVTransferError):
    """The peer could not be reached or went away mid-transfer."""


class TransferAborted(KVTransferError):
    """This side stopped the transfer: `abort()` was called, the stream was cancelled, or its
    own payload transport (shm, collective) failed."""
