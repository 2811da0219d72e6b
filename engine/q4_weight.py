"""4-bit weights in blocks of 32 inputs with a scale and a minimum each (w = d * q + m, q in
0..15): a GGUF file's Q4_1 blocks, kept as the file stores them, so `--dtype int4` runs the
model's own weights in half the bytes of int8, laid out for engine/csrc/linear_q4.c. Nothing
is quantized to 4 bits here: a checkpoint without Q4_1 blocks runs its layers in int8."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # inputs a block
Q4_1_BYTES = 20  # a GGUF Q4_1 block: fp16 d, fp16 m, 16 bytes of nibbles (input j low, j + 16 high)


@dataclass(frozen=True)
class Q4Weight:
    """W [out, in] as linear_q4.c reads it: per 16 output channels and block, four 64-byte vectors
    of nibbles (byte i of channel c in vector g: inputs 4g + i low, 16 + 4g + i high: a Q4_1
    block's own byte 4g + i), then the 16 channels' d and m."""

    packed: torch.Tensor  # uint8 [out / 16, in / 32, 4, 16, 4]
    dm: torch.Tensor  # fp32 [out / 16, in / 32, 2, 16]
    out_features: int
    in_features: int

    @staticmethod
    def tiles(out_features: int, in_features: int) -> bool:
        return out_features % 16 == 0 and in_features % BLOCK == 0

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor) -> Q4Weight | None:
        """blocks: uint8 [out, in / 32 * 20], a GGUF Q4_1 tensor's rows; None where it does not tile."""
        n, nb = blocks.shape[0], blocks.shape[1] // Q4_1_BYTES
        if not cls.tiles(n, nb * BLOCK):
            return None
        b = blocks.contiguous().view(n, nb, Q4_1_BYTES)
        dm = b[..., :4].contiguous().view(torch.float16).float()  # [n, nb, 2]: d, m
        return cls._pack(b[..., 4:], dm[..., 0], dm[..., 1])

    @classmethod
    def _pack(cls, nibbles: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Q4Weight:
        n, nb = d.shape
        packed = nibbles.reshape(n // 16, 16, nb, 4, 4).permute(0, 2, 3, 1, 4).contiguous()
        dm = torch.stack([d.view(n // 16, 16, nb), m.view(n // 16, 16, nb)], dim=2).permute(0, 3, 2, 1)
        return cls(packed, dm.contiguous().float(), n, nb * BLOCK)

    def dequantize(self) -> torch.Tensor:
        """W [out, in] in fp32: d * q + m."""
        p = self.packed.permute(0, 3, 1, 2, 4).reshape(self.out_features, -1, 16)  # [n, nb, 16] bytes
        q = torch.cat([p & 15, p >> 4], dim=-1).float()  # [n, nb, 32]
        dm = self.dm.permute(0, 3, 1, 2).reshape(self.out_features, -1, 2)
        return (dm[..., :1] * q + dm[..., 1:]).reshape(self.out_features, self.in_features)

    def state(self, name: str) -> dict[str, torch.Tensor]:
        return {f"{name}.q4_packed": self.packed, f"{name}.q4_dm": self.dm}

    @classmethod
    def from_state(cls, packed: torch.Tensor, dm: torch.Tensor) -> Q4Weight:
        return cls(packed, dm, packed.shape[0] * 16, packed.shape[1] * BLOCK)


def q4_1_rows(raw: np.ndarray) -> torch.Tensor:
    """A GGUF Q4_1 tensor's raw bytes as uint8 rows [out, in / 32 * 20] (a copy, off the mmap)."""
    return torch.from_numpy(np.array(raw, dtype=np.uint8, order="C")).reshape(raw.shape[0], -1)
