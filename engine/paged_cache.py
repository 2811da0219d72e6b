"""The paged KV cache tensor: where every layer's keys and values live.

One tensor holds the whole cache (KV transfer ships slices of it):

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, width]
              |      |      |           |
              |      |      |           +-- token slot within the block
              |      |      +-- physical block id (from KVCacheManager's block tables)
              |      +-- 0 = keys (after RoPE), 1 = values
              +-- decoder layer

    block b of layer l:  kv[l, :, b]            -> [2, block_size, kv_heads, head_dim]
    token t of request:  block = table[t // block_size], slot = t % block_size
    flat slot index:     block * block_size + slot   (the "slot mapping" the model writes by)

width is head_dim, or head_dim + 4 in a coded (int8/fp8) cache: engine/kv_codec.py.
A block is contiguous per (layer, k|v): block_size * kv_heads * width elements, so
one (layer, block) pair is 2 such runs. Bookkeeping (which block belongs to whom) lives
in engine.kv_cache and never touches this tensor.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from engine.config import ModelConfig
from engine.kv_codec import KVCodec


def block_bytes(model: ModelConfig, block_size: int, codec: KVCodec) -> int:
    """Bytes of one block across all layers, keys and values, as `codec` stores them."""
    return model.num_layers * 2 * block_size * model.num_kv_heads * codec.width(model.head_dim) * codec.storage.itemsize


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros. On the CPU it lies over an anonymous mapping, whose pages the kernel
    gives, zeroed, as they are first written: a cache sized for the host's memory (engine/
    kv_budget.py) takes what its requests have used, and no time to start (torch.zeros wrote
    2 GiB in 0.67 s, each worker at startup, and kept all of it resident)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    return torch.frombuffer(mmap.mmap(-1, numel * dtype.itemsize), dtype=dtype, count=numel).view(shape)


class PagedKVCache:
    """Owns the KV tensor; reads and writes whole blocks for KV transfer."""

    def __init__(
        self,
        model: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        codec: KVCodec | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """dtype: what attention computes in; codec: how the cache stores it (default: as is)."""
        self.codec = codec or KVCodec.of("auto", dtype)
        self.num_layers = model.num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = model.num_kv_heads
        self.head_dim = model.head_dim
        self.width = self.codec.width(model.head_dim)
        self.dtype = self.codec.storage  # of the tensor: what KV transfer moves
        self._block_bytes = block_bytes(model, block_size, self.codec)
        shape = (model.num_layers, 2, num_blocks, block_size, model.num_kv_heads, self.width)
        self._place(_zeros(shape, self.dtype, torch.device(device)))

    def _place(self, kv: torch.Tensor) -> None:
        self.kv = kv
        # flat views per layer: [num_blocks * block_size, kv_heads, width]
        self.k_flat = [kv[i, 0].view(-1, self.num_kv_heads, self.width) for i in range(self.num_layers)]
        self.v_flat = [kv[i, 1].view(-1, self.num_kv_heads, self.width) for i in range(self.num_layers)]
        # on the CPU, a row per (layer, k|v, block), as bytes:
        # [num_layers * 2 * num_blocks, block_size * kv_heads * width * itemsize]
        on_cpu = kv.device.type == "cpu"
        self._rows = kv.view(torch.uint8).numpy().reshape(self.num_layers * 2 * self.num_blocks, -1) if on_cpu else None

    def rehome(self, kv: torch.Tensor, contents: bool = True) -> None:
        """Move the cache into `kv`: a contiguous tensor of the same shape and dtype (one over
        shared memory: kv_transfer/in_place.py), with its contents unless `contents` is False (no
        block's contents matter yet: copying 2 GiB of zeros into /dev/shm took 2.7 s). Call it
        before the engine runs."""
        if kv.shape != self.kv.shape or kv.dtype != self.dtype or not kv.is_contiguous() or kv.device != self.device:
            raise ValueError(f"cannot rehome a {tuple(self.kv.shape)}/{self.dtype} cache into {tuple(kv.shape)}")
        if contents:
            kv.copy_(self.kv)
        self._place(kv)

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of one layer's keys (or values)."""
        return (self.block_size, self.num_kv_heads, self.width)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, keys and values."""
        return self._block_bytes

    def write(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new keys and values, [T, kv_heads, head_dim], at flat `slots`. Returns
        them as the cache now holds them (coded and decoded again), so attention over a chunk's own
        keys sees what a later read of the cache would: results do not depend on chunking."""
        if self.codec.passthrough:
            self.k_flat[layer].index_copy_(0, slots, k)
            self.v_flat[layer].index_copy_(0, slots, v)
            return k, v
        k_rows, v_rows = self.codec.encode(k), self.codec.encode(v)
        self.k_flat[layer].index_copy_(0, slots, k_rows)
        self.v_flat[layer].index_copy_(0, slots, v_rows)
        return self.codec.decode(k_rows), self.codec.decode(v_rows)

    def read_blocks(self, block_ids: Sequence[int], layers: slice = slice(None)) -> torch.Tensor:
        """A copy of the given blocks: [layers, 2, len(block_ids), block_size, kv_heads, head_dim]."""
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        return self.kv[layers].index_select(2, idx)

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor, layers: slice = slice(None)) -> None:
        """Write `data` ([layers, 2, len(block_ids), block_size, kv_heads, head_dim]) into the given
        blocks. Raises ValueError on a shape or dtype mismatch, IndexError on a block id out of range.

        A serial copy (numpy, not torch): it runs on the KV server's threads, where a parallel
        torch op would give each thread an OpenMP team of its own beside the engine loop's
        (engine/torch_threads.py: every region of both teams then slows down)."""
        span = range(self.num_layers)[layers]
        expected = (len(span), 2, len(block_ids), *self.block_shape)
        if tuple(data.shape) != expected or data.dtype != self.dtype:
            raise ValueError(f"KV data {tuple(data.shape)}/{data.dtype} does not match {expected}/{self.dtype}")
        if not block_ids:
            return
        if min(block_ids) < 0 or max(block_ids) >= self.num_blocks:
            raise IndexError(f"block ids {list(block_ids)[:8]} outside [0, {self.num_blocks})")
        if self._rows is None:  # off the CPU: the device copies
            idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
            self.kv[span.start : span.stop].index_copy_(2, idx, data.to(self.device))
            return
        rows = self._row_index(span, block_ids)
        # data as rows: [len(span) * 2 * len(block_ids), block bytes], in `rows` order
        self._rows[rows] = data.contiguous().view(torch.uint8).numpy().reshape(len(rows), -1)

    def read_blocks_serial(self, block_ids: Sequence[int]) -> torch.Tensor:
        """`read_blocks` of every layer as a serial copy (numpy, not torch), for the same reason as
        `write_blocks`: it runs off the engine loop's thread (a write-back's source)."""
        if self._rows is None:
            return self.read_blocks(block_ids).cpu()
        picked = self._rows[self._row_index(range(self.num_layers), block_ids)]
        return torch.from_numpy(picked).view(self.dtype).view(self.num_layers, 2, len(block_ids), *self.block_shape)

    def _row_index(self, span: range, block_ids: Sequence[int]) -> npt.NDArray[np.int64]:
        """The `_rows` of blocks `block_ids` in layers `span`, (layer, k|v, block) in that order."""
        pairs = (np.asarray(span)[:, None] * 2 + np.arange(2)).reshape(-1)  # (layer, k|v) of each run of data
        rows: npt.NDArray[np.int64] = (pairs[:, None] * self.num_blocks + np.asarray(block_ids)).reshape(-1)
        return rows
