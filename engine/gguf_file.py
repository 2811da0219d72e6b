"""A fast reader of a GGUF file's header: metadata and tensor index.

`gguf.GGUFReader` builds a numpy view per metadata item, which takes ~10 s on the
98k-entry vocab and merges of SmolLM2. This parser walks the header with `struct`
(~0.1 s) and hands raw tensor bytes to the `gguf` package for dequantization.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first), e.g. [out_features, in_features]
    qtype: int
    offset: int
    nbytes: int


class GGUFFile:
    """Metadata (`fields`) and tensors (`tensor_data`) of a GGUF v2/v3 file, memory-mapped."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        magic, version = struct.unpack_from("<4sI", self._buf, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{self.path} is not a GGUF v2/v3 file")
        self._pos = 8
        n_tensors, n_kv = self._unpack("<QQ")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.fields[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            qtype, offset = self._unpack("<IQ")
            infos.append((name, tuple(reversed(dims)), qtype, offset))
        align = int(self.fields.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        self.tensors = [GGUFTensor(n, s, q, data_start + o, _nbytes(s, q)) for n, s, q, o in infos]

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        vals = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return vals

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buf, self._pos)
        start = self._pos + 8
        self._pos = start + n
        return self._buf[start : start + n].decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            itype, count = self._unpack("<IQ")
            if itype in _SCALARS:
                fmt = _SCALARS[itype]
                arr = np.frombuffer(self._buf, dtype=np.dtype(fmt), count=count, offset=self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            return [self._value(itype) for _ in range(count)]
        return self._unpack(_SCALARS[vtype])[0]

    def tensor_data(self, t: GGUFTensor) -> np.ndarray:
        """The tensor's raw bytes, shaped as `gguf.quants.dequantize` expects."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.qtype)]
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return raw.reshape(*t.shape[:-1], t.shape[-1] // block * type_size)

    def dequantize(self, t: GGUFTensor) -> np.ndarray:
        """float32 values of the tensor, shaped `t.shape`."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        out = dequantize(self.tensor_data(t), GGMLQuantizationType(t.qtype))
        return np.asarray(out, dtype=np.float32).reshape(t.shape)


def _nbytes(shape: tuple[int, ...], qtype: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    n = 1
    for d in shape:
        n *= d
    return n // block * type_size
