"""One chunk's payload, written the transport's way, and what goes in its Push message.

in place          copied into the receiver's own blocks (kv_transfer/in_place.py): the
                  message is the header alone, nothing to checksum, and headers that
                  continue each other (the next layers of the same blocks) go as one
                  (`InPlaceHeaders`)
shm               gathered straight into a shared-memory segment and checksummed there
grpc, collective  gathered here, handed to the writer, checksummed
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kv_transfer.in_place_writer import InPlaceWriter
from kv_transfer.payload import PayloadWriter, ShmWriter
from kv_transfer.wire import DTYPE_NAMES, checksum, gather, tensor_bytes
from protos.gen import kv_transfer_pb2 as pb

# An in-place header waits at most this long for the next layers to join it: each chunk the
# receiver takes renews its lease, so a slow prefill still sends one about this often.
HOLD_S = 0.2


def chunk_header(
    request_id: str, token: str, layer_start: int, blocks: list[int], data: torch.Tensor, src: torch.Tensor | None
) -> pb.KVChunkHeader:
    """The header of a chunk of `data` ([layers, 2, blocks, ...]), or with `src`, of its blocks `src`."""
    shape = tuple(data.shape) if src is None else (data.shape[0], 2, len(src), *data.shape[3:])
    return pb.KVChunkHeader(
        request_id=request_id,
        transfer_token=token,
        layer_start=layer_start,
        layer_end=layer_start + data.shape[0],
        block_ids=blocks,
        dtype=DTYPE_NAMES[data.dtype],
        shape=list(shape),
        payload_bytes=torch.Size(shape).numel() * data.element_size(),
    )


def write_chunk(
    writer: PayloadWriter, header: pb.KVChunkHeader, data: torch.Tensor, src: torch.Tensor | None
) -> memoryview | None:
    """Write the payload of `header` (its shape, layers and destination blocks set): `data`
    itself, or with `src`, those blocks of `data` ([layers, 2, num_blocks, ...]) gathered. Fills
    the header's transport, location and checksum; returns the bytes that follow the header in
    its message, or None when it was written in place (the header is all there is to send).
    The caller keeps the writer open meanwhile."""
    if isinstance(writer, InPlaceWriter):
        if writer.claimed:
            writer.write(header, data, src)
            return None
        writer = writer.fallback
    if isinstance(writer, ShmWriter):
        payload = writer.claim(header, tuple(header.shape), data.dtype)  # over shared memory
        if src is None:
            payload.copy_(data)
        else:
            gather(data, src, payload)
        inband = memoryview(b"")
    else:
        payload = data if src is None else gather(data, src)
        inband = writer.put(header, payload)
    header.checksum = checksum(tensor_bytes(payload))
    return inband


class InPlaceHeaders:
    """In-place chunks' headers, merged while each continues the last (the next layers of the
    same blocks): the receiver copies nothing, so one message says what one a layer did, and a
    transfer's messages (and the receiver's wake-ups, which take cores from the copy) drop from
    one a layer to a few. Not thread-safe: the push's producer alone calls it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: pb.KVChunkHeader | None = None
        self._since = 0.0

    def add(self, h: pb.KVChunkHeader) -> list[pb.KVChunkHeader]:
        """Hold `h`, joined to the held header if it continues it; the headers to send now."""
        held, now = self._held, self._clock()
        if held is not None and held.layer_end == h.layer_start and held.block_ids == h.block_ids:
            held.layer_end = h.layer_end
            held.shape[0] += h.shape[0]
            held.payload_bytes += h.payload_bytes
            return self.flush() if now - self._since > HOLD_S else []
        out = self.flush()
        self._held, self._since = h, now
        return out

    def flush(self) -> list[pb.KVChunkHeader]:
        held, self._held = self._held, None
        return [] if held is None else [held]
