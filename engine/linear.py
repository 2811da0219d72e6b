"""Matrix products against the model's weights, in the engine's weight format.

Float weights are kept transposed ([in, out], contiguous): `x @ w` runs 1.5-3x faster
than F.linear on CPU for the small batches decode sees. int8 weights are quantized
per output channel and run through fbgemm's dynamic-quantized kernel (VNNI on x86):
a quarter of fp32's bytes, which is what bounds decode.
"""

from __future__ import annotations

import torch


class Projection:
    """y = x @ W.T for one weight W: [out, in]. Calls are [T, in] -> [T, out]."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, int8: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        self.int8 = int8
        if int8:
            w = weight.float()
            scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8).double()
            zero = torch.zeros(w.shape[0], dtype=torch.long)
            q = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(q, None)
        else:
            self._wt = weight.t().to(dtype).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8:
            y: torch.Tensor = torch.ops.quantized.linear_dynamic(x, self._packed, True)
            return y
        return torch.mm(x, self._wt)


def cpu_has_bf16() -> bool:
    """True when this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); elsewhere bf16
    matmuls are emulated and ~4x slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags
