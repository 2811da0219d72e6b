"""Framing of Push messages and the layout both sides must agree on.

    Push message = u32le header length | KVChunkHeader (protobuf) | payload bytes

The payload is a C-contiguous tensor [layers, 2, blocks, block_size, kv_heads, head_dim]
(engine.paged_cache's layout, sliced to some layers and blocks), checksummed with xxh64.
"""

from __future__ import annotations

import struct

import torch
import xxhash

from engine.paged_cache import PagedKVCache
from protos.gen import kv_transfer_pb2 as pb

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_LEN = struct.Struct("<I")


def layout_of(cache: PagedKVCache) -> pb.KVLayout:
    return pb.KVLayout(
        num_layers=cache.num_layers,
        block_size=cache.block_size,
        num_kv_heads=cache.num_kv_heads,
        head_dim=cache.head_dim,
        dtype=DTYPE_NAMES[cache.dtype],
    )


def checksum(data: bytes | memoryview) -> int:
    return int(xxhash.xxh64_intdigest(data))


def frame(header: pb.KVChunkHeader, payload: bytes | memoryview = b"") -> bytes:
    h = header.SerializeToString()
    return b"".join((_LEN.pack(len(h)), h, payload))


def unframe(message: bytes) -> tuple[pb.KVChunkHeader, memoryview]:
    """Header and a zero-copy view of the payload. Raises ValueError on a malformed frame."""
    if len(message) < _LEN.size:
        raise ValueError("frame shorter than its length prefix")
    (n,) = _LEN.unpack_from(message, 0)
    if _LEN.size + n > len(message):
        raise ValueError("frame header runs past the message")
    header = pb.KVChunkHeader.FromString(message[_LEN.size : _LEN.size + n])
    return header, memoryview(message)[_LEN.size + n :]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().data
