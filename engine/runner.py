"""Turns a SchedulerOutput into model inputs, runs the model and samples.

The only torch-facing part of a step; one host sync (the sampler's .tolist()).
"""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, PrefillChunk
from engine.kv_cache import KVCacheManager
from engine.model import LayerCallback, LlamaModel
from engine.paged_cache import PagedKVCache
from engine.sampler import Sampler, SamplerOutput
from engine.scheduler import ScheduledChunk, SchedulerOutput


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: PagedKVCache, kv: KVCacheManager) -> None:
        self.model = model
        self.cache = cache
        self.kv = kv
        self.sampler = Sampler()
        self.block_size = cache.block_size

    def execute(self, out: SchedulerOutput, on_layer_done: LayerCallback | None = None) -> SamplerOutput:
        """Run one step; returns one sample per completing chunk, in `out.chunks` order."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        completing: list[ScheduledChunk] = []
        tables = [self.kv.block_table(c.request.request_id) for c in out.decodes]
        for c, table in zip(out.decodes, tables, strict=True):
            p = c.start
            ids.append(c.request.token_ids[p])
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            if c.completes:
                logits_rows.append(len(ids) - 1)
                completing.append(c)
        decode_tables = decode_mask = None
        if out.decodes:
            max_blocks = max((c.end + bs - 1) // bs for c in out.decodes)
            decode_tables = torch.tensor([t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks])) for t in tables])
            lens = torch.tensor([c.end for c in out.decodes])
            decode_mask = (torch.arange(max_blocks * bs).unsqueeze(0) < lens.unsqueeze(1)).view(
                len(out.decodes), 1, 1, -1
            )  # [D, 1, 1, L]
        prefills: list[PrefillChunk] = []
        for c in out.prefills:
            table = self.kv.block_table(c.request.request_id)
            start = len(ids)
            ids.extend(c.request.token_ids[c.start : c.end])
            pos.extend(range(c.start, c.end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(c.start, c.end))
            needed = (c.end + bs - 1) // bs
            prefills.append(PrefillChunk(start, len(ids), c.start, torch.tensor(table[:needed])))
            if c.completes:
                logits_rows.append(len(ids) - 1)
                completing.append(c)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            num_decodes=len(out.decodes),
            decode_block_tables=decode_tables,
            decode_mask=decode_mask,
            prefills=tuple(prefills),
        )
        logits = self.model.forward(
            torch.tensor(ids),
            torch.tensor(pos),
            self.cache,
            meta,
            torch.tensor(logits_rows, dtype=torch.long),
            on_layer_done,
        )
        params = [c.request.params for c in completing]
        index = [c.request.num_output_tokens + c.request.params.output_offset for c in completing]
        return self.sampler(logits, params, index)
