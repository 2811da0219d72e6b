"""Framing of Push messages and the layout both sides must agree on.

    Push message = u32le header length | KVChunkHeader (protobuf) | payload bytes

The payload is a C-contiguous tensor [layers, 2, blocks, block_size, kv_heads, head_dim]
(engine.paged_cache's layout, sliced to some layers and blocks), checksummed with xxh64.
A payload over the receiver's max_chunk_bytes goes as several chunks (`split`): whole layers
while one layer of all its blocks fits, else runs of blocks within one layer:

    data [layers=3, 2, blocks=4, ...], limit = 2 layers' worth     limit = 2 blocks' worth
        ┌──────────┐ ┐                                                ┌─────┬─────┐
        │ layer 0  │ ├ chunk 0                                 layer 0 │  0  │  1  │
        │ layer 1  │ ┘                                                ├─────┼─────┤
        │ layer 2  │ ─ chunk 1                                 layer 1 │  2  │  3  │  ...
        └──────────┘                                                  └─────┴─────┘
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

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


def split(data: torch.Tensor, blocks: list[int], max_bytes: int) -> Iterator[tuple[int, list[int], torch.Tensor]]:
    """Cut data [layers, 2, len(blocks), block_size, kv_heads, head_dim] into chunks of at most
    `max_bytes` (0: no limit). Yields (first layer, relative to data; destination blocks; chunk).
    Raises ValueError if one layer of one block is over the limit."""
    total = data.numel() * data.element_size()
    if max_bytes <= 0 or total <= max_bytes:
        yield 0, blocks, data
        return
    layers = data.shape[0]
    per_layer = total // layers
    if per_layer <= max_bytes:
        step = max_bytes // per_layer
        for lo in range(0, layers, step):
            yield lo, blocks, data[lo : lo + step]
        return
    per_block = per_layer // len(blocks)
    if per_block > max_bytes:
        raise ValueError(f"one layer of one block is {per_block} bytes, over the {max_bytes}-byte chunk limit")
    step = max_bytes // per_block
    for layer in range(layers):
        for b in range(0, len(blocks), step):
            # [1, 2, step, block_size, kv_heads, head_dim]: a copy, since a run of blocks is not contiguous
            yield layer, blocks[b : b + step], data[layer : layer + 1, :, b : b + step].contiguous()
