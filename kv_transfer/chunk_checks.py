"""What a receiver checks of one chunk before a byte of it is written: its place in the cache
(layers, blocks, dtype, shape, size) and its payload (transport, size, checksum, KV scales).
A failed check raises ChunkRejected with a reason code (kv_transfer/status.py maps it)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from engine.kv_codec import valid_scales
from engine.paged_cache import PagedKVCache
from kv_transfer.errors import ChunkRejected
from kv_transfer.payload import PayloadReader
from kv_transfer.wire import CODED, DTYPES, checksum, row_width
from protos.gen import kv_transfer_pb2 as pb


def check_place(
    layout: pb.KVLayout, max_chunk_bytes: int, reserved: list[int], h: pb.KVChunkHeader
) -> tuple[list[int], tuple[int, ...]]:
    """The chunk's destination blocks and payload shape. Raises ChunkRejected."""
    lo, hi = h.layer_start, h.layer_end
    if not 0 <= lo < hi <= layout.num_layers:
        raise ChunkRejected("bad_layers", f"layers [{lo}, {hi}) outside [0, {layout.num_layers})")
    blocks = list(h.block_ids)
    if not blocks or not set(blocks) <= set(reserved) or len(set(blocks)) != len(blocks):
        raise ChunkRejected("bad_blocks", f"blocks {blocks[:8]} are not within the reservation")
    if h.dtype != layout.dtype:
        raise ChunkRejected("bad_dtype", f"dtype {h.dtype!r}, cache holds {layout.dtype!r}")
    shape = (hi - lo, 2, len(blocks), layout.block_size, layout.num_kv_heads, row_width(layout))
    if tuple(h.shape) != shape:
        raise ChunkRejected("bad_shape", f"shape {tuple(h.shape)}, expected {shape}")
    if h.payload_bytes != DTYPES[h.dtype].itemsize * torch.Size(shape).numel():
        raise ChunkRejected("bad_size", f"payload_bytes {h.payload_bytes} does not match shape {shape}")
    if h.payload_bytes > max_chunk_bytes and h.transport != "in_place":  # an in-place one carries no payload
        raise ChunkRejected("too_large", f"{h.payload_bytes} bytes in one chunk, at most {max_chunk_bytes}")
    return blocks, shape


def read_payload(
    readers: Mapping[str, PayloadReader], h: pb.KVChunkHeader, inband: memoryview, shape: tuple[int, ...]
) -> torch.Tensor:
    """The chunk's payload as a read-only tensor of `shape`, verified. Raises ChunkRejected."""
    reader = readers.get(h.transport)
    if reader is None:
        raise ChunkRejected("bad_transport", f"unknown transport {h.transport!r}")
    try:
        payload = reader.get(h, inband)
    except (OSError, ValueError) as e:
        raise ChunkRejected("bad_payload", str(e)) from e
    if len(payload) != h.payload_bytes:
        raise ChunkRejected("bad_size", f"payload is {len(payload)} bytes, header says {h.payload_bytes}")
    if checksum(payload) != h.checksum:
        raise ChunkRejected("bad_checksum", "payload checksum mismatch")
    with warnings.catch_warnings():  # payloads are read-only views (gRPC bytes, mmap); only read
        warnings.simplefilter("ignore", UserWarning)
        data = torch.frombuffer(payload, dtype=DTYPES[h.dtype]).view(shape)
    check_scales(h, data)
    return data


def check_scales(h: pb.KVChunkHeader, data: torch.Tensor) -> None:
    if h.dtype in CODED and not valid_scales(data):
        raise ChunkRejected("bad_scales", "a KV scale is negative or not finite")


def check_written(h: pb.KVChunkHeader, cache: PagedKVCache, blocks: list[int]) -> None:
    """An in-place chunk, which the sender wrote itself: a coded cache's scales, read where they
    landed (nothing is read of a plain cache). Raises ChunkRejected."""
    if h.dtype in CODED:
        check_scales(h, cache.read_blocks(blocks, slice(h.layer_start, h.layer_end)))
