"""Static inputs for replayed decode steps: batch-size buckets, padding, and buffers reused.

A captured decode step (a CUDA graph) replays the same kernels on the same memory, so its
inputs must live in tensors that never move and whose shapes never change. A decode-only
batch of `rows` requests, whose longest block table has `blocks` entries, runs in the bucket

    (bucket_rows(rows), bucket_width(blocks))     e.g. 5 rows, 20 blocks -> (8, 32)

and its inputs are copied into that bucket's buffers. The rows past `rows` are padding:
token 0 at position 0, writing its KV into the pad slot (a slot of a block no request ever
holds) and attending to that one slot, so a padded row computes something finite that no one
reads. Widths are powers of two from one tile (engine/paged_decode.py reads tiles of
TILE_BLOCKS blocks), so the paged kernel's loop over a bucket covers at most twice the
longest row. Nothing here needs a GPU: the buffers take any device.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.paged_decode import TILE_BLOCKS

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def bucket_rows(rows: int, buckets: Sequence[int] = ROW_BUCKETS) -> int | None:
    """The smallest bucket that holds `rows` decode rows; None past the largest (run eagerly)."""
    if rows < 1:
        raise ValueError(f"a decode batch has at least one row, got {rows}")
    i = bisect.bisect_left(buckets, rows)
    return buckets[i] if i < len(buckets) else None


def bucket_width(blocks: int, max_blocks: int) -> int:
    """Block-table columns for a batch whose longest table has `blocks` entries: the next power
    of two from one tile, capped at `max_blocks` (a request's most blocks)."""
    if not 1 <= blocks <= max_blocks:
        raise ValueError(f"{blocks} blocks outside [1, {max_blocks}]")
    width = TILE_BLOCKS
    while width < blocks:
        width *= 2
    return min(width, max_blocks)


@dataclass(frozen=True)
class DecodeBatch:
    """A decode-only step's inputs as the scheduler gives them: one entry a row."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]  # flat cache slot each row's new KV goes to
    tables: list[list[int]]  # each row's block table (unpadded)
    lens: list[int]  # each row's context, its new token included


class StaticInputs:
    """One bucket's device buffers, filled in place by `fill` and never reallocated."""

    def __init__(self, rows: int, width: int, device: torch.device | str, pad_slot: int, pad_block: int) -> None:
        self.rows, self.width = rows, width
        self.pad_slot, self.pad_block = pad_slot, pad_block
        long = torch.long
        self.token_ids = torch.zeros(rows, dtype=long, device=device)
        self.positions = torch.zeros(rows, dtype=long, device=device)
        self.slots = torch.full((rows,), pad_slot, dtype=long, device=device)
        self.block_tables = torch.full((rows, width), pad_block, dtype=long, device=device)
        self.seq_lens = torch.ones(rows, dtype=long, device=device)
        # the host side of one copy per step: [rows * (4 + width)] longs
        self._host = torch.empty(rows * (4 + width), dtype=long, pin_memory=torch.device(device).type == "cuda")

    def fill(self, batch: DecodeBatch) -> int:
        """Copy `batch` in, padding the rest; returns its row count. Raises ValueError if it
        does not fit this bucket."""
        n = len(batch.token_ids)
        widest = max((len(t) for t in batch.tables), default=0)
        if not 1 <= n <= self.rows or widest > self.width:
            raise ValueError(f"{n} rows x {widest} blocks do not fit a {self.rows} x {self.width} bucket")
        pad = self.rows - n
        host = self._host
        r, w = self.rows, self.width
        host[:r] = torch.tensor(batch.token_ids + [0] * pad)
        host[r : 2 * r] = torch.tensor(batch.positions + [0] * pad)
        host[2 * r : 3 * r] = torch.tensor(batch.slots + [self.pad_slot] * pad)
        host[3 * r : 4 * r] = torch.tensor(batch.lens + [1] * pad)
        tables = [t + [self.pad_block] * (w - len(t)) for t in batch.tables] + [[self.pad_block] * w] * pad
        host[4 * r :] = torch.tensor(tables).flatten()
        for dst, src in (
            (self.token_ids, host[:r]),
            (self.positions, host[r : 2 * r]),
            (self.slots, host[2 * r : 3 * r]),
            (self.seq_lens, host[3 * r : 4 * r]),
            (self.block_tables, host[4 * r :].view(r, w)),
        ):
            dst.copy_(src, non_blocking=True)
        return n


class BucketBuffers:
    """Every bucket's StaticInputs, made on first use and then reused for every step that
    lands in that bucket (a captured graph holds their addresses)."""

    def __init__(self, device: torch.device | str, max_blocks: int, pad_slot: int, pad_block: int) -> None:
        self.device = device
        self.max_blocks = max_blocks
        self.pad_slot, self.pad_block = pad_slot, pad_block
        self._inputs: dict[tuple[int, int], StaticInputs] = {}

    def bucket(self, batch: DecodeBatch) -> tuple[int, int] | None:
        """The (rows, width) bucket `batch` runs in; None if it has too many rows for any."""
        rows = bucket_rows(len(batch.token_ids))
        if rows is None:
            return None
        return rows, bucket_width(max(len(t) for t in batch.tables), self.max_blocks)

    def inputs(self, key: tuple[int, int]) -> StaticInputs:
        if key not in self._inputs:
            self._inputs[key] = StaticInputs(*key, self.device, self.pad_slot, self.pad_block)
        return self._inputs[key]

    def fill(self, batch: DecodeBatch) -> StaticInputs | None:
        """`batch` copied into its bucket's buffers; None if no bucket holds it (run eagerly)."""
        key = self.bucket(batch)
        if key is None:
            return None
        inputs = self.inputs(key)
        inputs.fill(batch)
        return inputs

    def buckets(self) -> list[tuple[int, int]]:
        return sorted(self._inputs)
