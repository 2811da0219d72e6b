"""One chunk's payload, written the transport's way, and the Push message that carries it.

in place  copied into the receiver's own blocks (kv_transfer/in_place.py); the message is
          the header alone, nothing to checksum
shm       gathered straight into a shared-memory segment and checksummed there
grpc, collective   gathered here, handed to the writer, checksummed
"""

from __future__ import annotations

import torch

from kv_transfer.in_place_writer import InPlaceWriter
from kv_transfer.payload import PayloadWriter, ShmWriter
from kv_transfer.wire import checksum, frame, gather, tensor_bytes
from protos.gen import kv_transfer_pb2 as pb


def write_chunk(writer: PayloadWriter, header: pb.KVChunkHeader, data: torch.Tensor, src: torch.Tensor | None) -> bytes:
    """Write the payload of `header` (its shape, layers and destination blocks set): `data`
    itself, or with `src`, those blocks of `data` ([layers, 2, num_blocks, ...]) gathered. Fills
    the header's transport, location and checksum; returns the framed message. The caller keeps
    the writer open meanwhile."""
    if isinstance(writer, InPlaceWriter):
        if writer.claimed:
            writer.write(header, data, src)
            return frame(header)
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
    return frame(header, inband)
