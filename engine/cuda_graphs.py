"""Decode steps replayed from CUDA graphs, one per (rows, width) bucket, as vLLM does.

On CUDA a small decode step is launch-bound: hundreds of kernels of a few microseconds each.
A decode-only step (no prefill chunk, no per-layer hook) copies its inputs into the static
buffers of its bucket (engine/graph_buckets.py) and replays the graph captured for that
bucket the first time it was seen; its attention goes through the block tables a tile at a
time (engine/paged_decode.py), so no shape depends on the rows' lengths. Padding rows write
their KV into the pad block, one block past those the block manager hands out.

The eager path (`ModelRunner.forward`) stays the reference: `EngineConfig(cuda_graphs=False)`
turns this off, and the GPU tests check the two give the same tokens. Nothing here runs off
CUDA.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention import AttentionMetadata
from engine.graph_buckets import BucketBuffers, DecodeBatch, StaticInputs
from engine.model import LlamaModel
from engine.paged_cache import PagedKVCache


class GraphedDecode:
    """The captured graphs of one engine: its model, its cache, one graph a bucket."""

    def __init__(self, model: LlamaModel, cache: PagedKVCache, max_blocks: int, pad_block: int) -> None:
        if cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA cache, not {cache.device}")
        self.model, self.cache = model, cache
        bs = cache.block_size
        self.buffers = BucketBuffers(cache.device, max_blocks, pad_slot=pad_block * bs, pad_block=pad_block)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None  # one memory pool shared by every graph (torch's handle)

    def logits(self, batch: DecodeBatch) -> torch.Tensor | None:
        """The batch's logits [rows, vocab] from its bucket's graph (captured now if new); None
        if no bucket holds it (the caller runs it eagerly)."""
        inputs = self.buffers.fill(batch)
        if inputs is None:
            return None
        key = (inputs.rows, inputs.width)
        if key not in self._graphs:
            self._graphs[key] = self._capture(inputs)
        graph, logits = self._graphs[key]
        graph.replay()
        return logits[: len(batch.token_ids)]

    def captured(self) -> list[tuple[int, int]]:
        return sorted(self._graphs)

    def _forward(self, inputs: StaticInputs) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=inputs.slots,
            num_decodes=inputs.rows,
            decode_block_tables=inputs.block_tables,
            decode_mask=None,
            prefills=(),
            decode_seq_lens=inputs.seq_lens,
        )
        rows = torch.arange(inputs.rows, device=inputs.token_ids.device)
        return self.model.forward(inputs.token_ids, inputs.positions, self.cache, meta, rows)

    def _capture(self, inputs: StaticInputs) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # warm up on a side stream (allocator and kernel caches), as torch.cuda.graphs advises;
        # the warm-up writes the same KV at the same slots the replay then writes
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(inputs)
        self._pool = graph.pool()
        return graph, logits
