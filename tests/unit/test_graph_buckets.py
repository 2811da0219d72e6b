"""engine/graph_buckets.py as a pure unit: which bucket a decode batch runs in, its padding,
and buffers reused in place (what a captured graph needs), on CPU."""

from __future__ import annotations

import pytest
import torch

from engine.graph_buckets import BucketBuffers, DecodeBatch, bucket_rows, bucket_width
from engine.paged_decode import TILE_BLOCKS


def batch(rows: int, blocks: int) -> DecodeBatch:
    return DecodeBatch(
        token_ids=[100 + i for i in range(rows)],
        positions=[10 * i for i in range(rows)],
        slots=[16 * i + 3 for i in range(rows)],
        tables=[[i + 1] * (blocks if i == 0 else 1) for i in range(rows)],
        lens=[5 + i for i in range(rows)],
    )


def test_rows_go_to_the_smallest_bucket_that_holds_them() -> None:
    assert [bucket_rows(n) for n in (1, 2, 3, 5, 8, 9, 17, 100, 128)] == [1, 2, 4, 8, 8, 16, 24, 128, 128]
    assert bucket_rows(129) is None
    with pytest.raises(ValueError):
        bucket_rows(0)


def test_widths_are_powers_of_two_from_one_tile_capped_at_a_requests_blocks() -> None:
    assert bucket_width(1, 512) == TILE_BLOCKS
    assert bucket_width(TILE_BLOCKS + 1, 512) == 2 * TILE_BLOCKS
    assert bucket_width(200, 512) == 256
    assert bucket_width(300, 400) == 400
    with pytest.raises(ValueError):
        bucket_width(401, 400)


def test_a_batch_is_padded_with_rows_that_touch_only_the_pad_slot() -> None:
    buffers = BucketBuffers("cpu", max_blocks=64, pad_slot=999, pad_block=62)
    b = batch(3, 20)
    inputs = buffers.fill(b)
    assert inputs is not None and (inputs.rows, inputs.width) == (4, 32)
    assert inputs.token_ids.tolist() == [100, 101, 102, 0]
    assert inputs.positions.tolist() == [0, 10, 20, 0]
    assert inputs.slots.tolist() == [3, 19, 35, 999]
    assert inputs.seq_lens.tolist() == [5, 6, 7, 1]
    assert inputs.block_tables[0].tolist() == [1] * 20 + [62] * 12
    assert inputs.block_tables[1].tolist() == [2] + [62] * 31
    assert inputs.block_tables[3].tolist() == [62] * 32


def test_the_same_buffers_are_reused_and_a_smaller_batch_clears_the_rows_after_it() -> None:
    buffers = BucketBuffers("cpu", max_blocks=64, pad_slot=999, pad_block=62)
    first = buffers.fill(batch(8, 3))
    assert first is not None
    addresses = [t.data_ptr() for t in (first.token_ids, first.slots, first.block_tables, first.seq_lens)]
    second = buffers.fill(batch(5, 2))  # same bucket (8 rows, one tile)
    assert second is first
    assert [t.data_ptr() for t in (second.token_ids, second.slots, second.block_tables, second.seq_lens)] == addresses
    assert second.slots.tolist()[5:] == [999] * 3 and second.seq_lens.tolist()[5:] == [1] * 3
    assert second.token_ids.tolist()[5:] == [0] * 3
    assert buffers.buckets() == [(8, TILE_BLOCKS)]
    assert buffers.fill(batch(200, 1)) is None  # more rows than any bucket: eager


def test_a_batch_that_does_not_fit_its_buffers_is_refused() -> None:
    buffers = BucketBuffers("cpu", max_blocks=64, pad_slot=0, pad_block=0)
    small = buffers.inputs((2, 16))
    with pytest.raises(ValueError, match="do not fit"):
        small.fill(batch(3, 1))
    with pytest.raises(ValueError, match="do not fit"):
        small.fill(batch(1, 17))
    assert small.token_ids.dtype == torch.long
