"""A decode step's layer stack as one C call (engine/csrc/decode_layers.c) where the model's every
layer projection has its per-row int8 weight, or every one its 4-bit weight: the calls
engine/fused_forward.py makes layer by layer, made from C, so the same bits without the Python
between them (~270 ctypes calls a step, each with a new output tensor).

The table of weight addresses is built once, with the model: a row per layer in the C file's
order (the two norms, then packed, sums and scale of qkv, o, gate_up and down; packed, dm and 0
for 4-bit weights)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention import AttentionMetadata
from engine.native import NativeOps
from engine.paged_cache import PagedKVCache

if TYPE_CHECKING:
    from engine.model import LlamaModel


class DecodeStack:
    def __init__(self, model: LlamaModel, weights: torch.Tensor, q4: bool) -> None:
        self._model = model
        self._weights = weights  # int64 [layers, 14]: addresses of tensors the model holds
        self._q4 = q4  # the projections' weights are 4-bit (else per-row int8)

    @classmethod
    def of(cls, model: LlamaModel) -> DecodeStack | None:
        """The model's stack, or None where a layer projection has neither a per-row int8 nor a
        4-bit weight, or the layers mix the two (fp32 weights, or a shape the kernels do not
        tile): those steps run layer by layer."""
        projections = [p for lw in model.layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down)]
        q4 = all(p.q4 is not None for p in projections)
        if not q4 and any(p.rows is None for p in projections):
            return None
        rows = []
        for lw in model.layers:
            row = [lw.attn_norm.data_ptr()]
            for p in (lw.qkv, lw.o, lw.gate_up, lw.down):
                if p.q4 is not None:
                    row += [p.q4.packed.data_ptr(), p.q4.dm.data_ptr(), 0]
                elif p.rows is not None:
                    row += [p.rows.packed.data_ptr(), p.rows.sums.data_ptr(), p.rows.scale.data_ptr()]
                if p is lw.o:
                    row.append(lw.mlp_norm.data_ptr())
            rows.append(row)
        return cls(model, torch.tensor(rows, dtype=torch.int64), q4)

    def run(
        self, native: NativeOps, h: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata
    ) -> None:
        """h [rows, hidden] (fp32, contiguous) through every layer, in place, as a step of decode
        rows only: each row's KV written at meta.slot_mapping, its attention over its table.
        Raises MemoryError without scratch."""
        cfg = self._model.config
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        assert tables is not None and lens is not None and cache.kv.is_contiguous()
        native.decode_layers(
            h, self._weights, self._q4, cache.kv, cfg, positions, self._model.cos,
            self._model.sin, meta.slot_mapping, tables, lens, cache.block_size,
        )  # fmt: skip
