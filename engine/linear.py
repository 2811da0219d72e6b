"""Matrix products against the model's weights, in the engine's weight format.

Float weights are kept transposed ([in, out], contiguous): `x @ w` runs 1.5-3x faster
than F.linear on CPU for the small batches decode sees. int8 weights are quantized
per output channel, a quarter of fp32's bytes, which is what bounds decode, and run through
engine/csrc/linear_i8.c where it builds (activations per row), else fbgemm's dynamic kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from engine.q4_weight import Q4Weight


@dataclass(frozen=True)
class RowQuantWeight:
    """An int8 weight laid out for the C kernel that quantizes activations per row
    (engine/csrc/linear_i8.c): 16 output channels x 4 inputs a 64-byte vector, as VNNI's dot
    product reads them."""

    packed: torch.Tensor  # int8 [out / 16, in / 4, 16, 4]
    sums: torch.Tensor  # int32 [out]: 128 x each channel's sum (the activations' +128 offset)
    scale: torch.Tensor  # fp32 [out]
    out_features: int
    in_features: int

    @classmethod
    def from_int8(cls, qweight: torch.Tensor, scale: torch.Tensor) -> RowQuantWeight | None:
        """qweight int8 [out, in], scale [out]; None where the shape does not tile (out a multiple
        of 16, in of 4) or a value is -128 (the kernel's AVX2 path needs |w| <= 127, which a
        symmetric quantization, as Projection's, gives)."""
        n, k = qweight.shape
        if n % 16 or k % 4 or bool((qweight == -128).any()):
            return None
        packed = qweight.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
        sums = (qweight.sum(dim=1, dtype=torch.int32) * 128).contiguous()
        return cls(packed, sums, scale.float().contiguous(), n, k)


class Projection:
    """y = x @ W.T for one weight W: [out, in]. Calls are [T, in] -> [T, out]."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, int8: bool = False) -> None:
        if int8:
            w = weight.float()
            scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
            # round(w x fp32 1 / scale), as torch.quantize_per_channel rounds (the same int8 on all
            # 211 of SmolLM2's matrices), without its quantized tensor, deprecated in torch 2.13
            qweight = torch.round(w * (1.0 / scale)[:, None]).clamp(-127, 127).to(torch.int8)
            self._load({"qweight": qweight, "scale": scale.double()})
        else:
            self._load({"wt": weight.t().to(dtype).contiguous()})

    @classmethod
    def of_q4(cls, q4: Q4Weight) -> Projection:
        """A projection of 4-bit weights (engine/q4_weight.py)."""
        p = cls.__new__(cls)
        p._load({}, q4)
        return p

    @classmethod
    def from_state(cls, state: Mapping[str, torch.Tensor], name: str) -> Projection:
        """The projection that `state(name)` described; an int8 one is only re-packed."""
        if f"{name}.q4_packed" in state:
            return cls.of_q4(Q4Weight.from_state(state[f"{name}.q4_packed"], state[f"{name}.q4_dm"]))
        p = cls.__new__(cls)
        p._load({k: state[f"{name}.{k}"] for k in ("qweight", "scale", "wt") if f"{name}.{k}" in state})
        return p

    def state(self, name: str) -> dict[str, torch.Tensor]:
        """The tensors this projection is made of, under `name.`: int8 values and scales, 4-bit
        blocks, or W.T."""
        if self.q4 is not None:
            return self.q4.state(name)
        if not self.int8:
            return {f"{name}.wt": self._wt}
        qweight, scale = self._int8_values()
        return {f"{name}.qweight": qweight, f"{name}.scale": scale}

    def _load(self, state: dict[str, torch.Tensor], q4: Q4Weight | None = None) -> None:
        self.q4 = q4  # 4-bit weights, for linear_q4.c (engine/native.py)
        self.int8 = "qweight" in state
        # int8: the per-row kernel's layout (engine/csrc/linear_i8.c), the one copy of the values
        # where they tile it; fbgemm's packed copy is made only if `__call__` runs (_fbgemm)
        self.rows: RowQuantWeight | None = None
        if q4 is not None:
            self.out_features, self.in_features = q4.out_features, q4.in_features
        elif self.int8:
            qw, self._scale = state["qweight"], state["scale"]
            self.out_features, self.in_features = qw.shape
            self.rows = RowQuantWeight.from_int8(qw, self._scale)
            self._qweight = qw if self.rows is None else None
        else:
            self._wt = state["wt"]
            self.in_features, self.out_features = self._wt.shape

    def to(self, device: torch.device) -> None:
        """Move the weight to `device`. Raises ValueError for int8 and int4 (their kernels, fbgemm's
        and engine/csrc's, run on the CPU only)."""
        if self.int8 or self.q4 is not None:
            if device.type != "cpu":
                kind = "int4" if self.q4 is not None else "int8"
                raise ValueError(f"{kind} projections run on the CPU only (fbgemm, engine/csrc), not on {device}")
            return
        self._wt = self._wt.to(device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.q4 is not None:  # the C kernel, as the fused steps call it; without it, W in fp32
            from engine.native import ops  # engine.native imports this module

            native = ops()
            if native is None:
                return x @ self.q4.dequantize().to(x.dtype).T
            return native.linear_q4(x.float().contiguous(), self.q4).to(x.dtype)
        if self.int8:
            y: torch.Tensor = torch.ops.quantized.linear_dynamic(x, self._fbgemm, True)
            return y
        return torch.mm(x, self._wt)

    def _int8_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int8 W [out, in] and its per-channel scales, as loaded (W back from the per-row layout)."""
        if self.rows is None:
            assert self._qweight is not None
            return self._qweight, self._scale
        r = self.rows
        return r.packed.permute(0, 2, 1, 3).reshape(r.out_features, r.in_features), self._scale

    def prepare_fbgemm(self) -> None:
        """Make fbgemm's copy now (LlamaModel, where its steps will run it), not in a first call."""
        if self.int8:
            self._fbgemm  # noqa: B018 (the cached property is made here)

    @functools.cached_property
    def _fbgemm(self) -> torch.ScriptObject:
        """fbgemm's packed copy of the int8 weight, made where fbgemm runs: without the C kernels,
        on a CPU whose int8 kernel is the plain loops (prefill steps), or for a weight they do not
        tile. On x86 with AVX2 or AVX512-VNNI every step takes the C kernels (engine/model.py's
        per_row), so this copy had doubled an int8 model's weight memory and its load for nothing,
        and the quantized tensor it is made from is deprecated in torch 2.13 (a warning at every
        start)."""
        qweight, scale = self._int8_values()
        zero = torch.zeros(qweight.shape[0], dtype=torch.long)
        q = torch._make_per_channel_quantized_tensor(qweight, scale, zero, 0)
        packed: torch.ScriptObject = torch.ops.quantized.linear_prepack(q, None)
        return packed


def auto_dtype(flags: frozenset[str], int8_kernels: bool = True) -> str:
    """The dtype `auto` resolves to on a CPU with these /proc/cpuinfo flags; see auto_dtype_reason."""
    return _auto(flags, int8_kernels)[0]


def auto_dtype_reason(flags: frozenset[str], int8_kernels: bool = True) -> str:
    """Why auto_dtype picks what it picks, in a few words, for the startup log line."""
    return _auto(flags, int8_kernels)[1]


def _auto(flags: frozenset[str], int8_kernels: bool) -> tuple[str, str]:
    # Measured on AVX512-BF16 + VNNI without AMX (SmolLM2, 2 cores): int8 decodes 2.3x and
    # prefills 2.6x faster than bf16 (half the weight bytes, VNNI dot products). Only AMX's
    # tiles make bf16 the faster one.
    if "amx_bf16" in flags:
        return "bf16", "AMX: bf16 matmuls run on the tiles"
    # Measured on a Zen 1 EPYC (AVX2, FMA, no AVX-512), SmolLM2: a Q4_1 file's layers kept in 4
    # bits (engine/csrc/linear_q4.c) ran prefill 1.3x, batch 16-64 1.2-1.4x and a decode step's
    # matmuls 1.26x faster than int8's AVX2 kernel. With VNNI, int8 keeps its dot products.
    if int8_kernels and {"avx2", "fma"} <= flags and "avx512_vnni" not in flags:
        return "int4", "AVX2 without AVX512-VNNI: a Q4_1 file's layers stay 4-bit, faster than int8 here"
    if int8_kernels:
        return "int8", "no AMX: int8 beats bf16 here"
    if "avx512_bf16" in flags:
        return "bf16", "no int8 kernels in this torch; AVX512-BF16 does bf16 in hardware"
    return "fp32", "no int8 kernels in this torch and no bf16 hardware (emulated bf16 is ~4x slower)"


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags in a /proc/cpuinfo text (x86 `flags`, Arm `Features`), of its first CPU."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU flags (none where /proc/cpuinfo cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpu_flags(f.read())
    except OSError:
        return frozenset()


def has_int8_kernels() -> bool:
    """True when this torch build has the x86 quantized engines Projection's int8 path runs on."""
    return bool({"x86", "fbgemm"} & set(torch.backends.quantized.supported_engines))
