"""`dtype="auto"` picks the dtype measured fastest for the CPU: bf16 with AMX, int4 (a Q4_1
file's layers as stored) with AVX2 but no AVX512-VNNI, else int8."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.linear import auto_dtype, auto_dtype_reason, cpu_flags, has_int8_kernels, parse_cpu_flags
from engine.weights import save_hf_dir
from tests.unit.tiny import TINY, tiny_weights

SAPPHIRE_RAPIDS = frozenset({"avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"})
COOPER_LAKE = frozenset({"avx512f", "avx512_vnni", "avx512_bf16"})  # bf16 dot products, no AMX
SKYLAKE = frozenset({"avx2", "avx512f"})
ZEN_1 = frozenset({"avx2", "fma"})  # no AVX-512


@pytest.mark.parametrize(
    ("flags", "int8_kernels", "dtype"),
    [
        (COOPER_LAKE, True, "int8"),  # measured: int8 2.3x bf16 on decode, 2.6x on prefill
        (frozenset({"avx512_bf16", "avx512_vnni"}), True, "int8"),
        (frozenset({"amx_bf16", "avx512_bf16"}), True, "bf16"),
        (SAPPHIRE_RAPIDS, True, "bf16"),
        (SKYLAKE, True, "int8"),
        (ZEN_1, True, "int4"),  # measured: a Q4_1 file's layers 1.2-1.4x faster in 4 bits than int8
        (SKYLAKE | ZEN_1 | {"avx512_vnni"}, True, "int8"),  # VNNI: int8's dot products
        (ZEN_1, False, "fp32"),
        (frozenset(), True, "int8"),  # flags unknown (no /proc/cpuinfo): int8 runs anywhere fbgemm does
        (SAPPHIRE_RAPIDS, False, "bf16"),
        (COOPER_LAKE, False, "bf16"),  # without int8 kernels, bf16 hardware still beats fp32
        (SKYLAKE, False, "fp32"),  # bf16 emulated: ~4x slower than fp32
        (frozenset(), False, "fp32"),
    ],
)
def test_auto_dtype(flags: frozenset[str], int8_kernels: bool, dtype: str) -> None:
    assert auto_dtype(flags, int8_kernels) == dtype
    reason = auto_dtype_reason(flags, int8_kernels)
    assert reason and "\n" not in reason


def test_the_reasons_name_what_decided() -> None:
    assert auto_dtype_reason(COOPER_LAKE) == "no AMX: int8 beats bf16 here"
    assert auto_dtype_reason(SAPPHIRE_RAPIDS).startswith("AMX")


def test_cpuinfo_flags_are_parsed_from_the_first_cpu() -> None:
    x86 = "processor\t: 0\nflags\t\t: fpu avx512_bf16 amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu other\n"
    assert parse_cpu_flags(x86) == frozenset({"fpu", "avx512_bf16", "amx_bf16"})
    assert parse_cpu_flags("processor\t: 0\nFeatures\t: fp asimd bf16\n") == frozenset({"fp", "asimd", "bf16"})
    assert parse_cpu_flags("") == frozenset()


def test_engine_config_resolves_auto_on_this_machine() -> None:
    assert EngineConfig(dtype="auto").weight_dtype == auto_dtype(cpu_flags(), has_int8_kernels())
    assert EngineConfig(dtype="fp32").weight_dtype == "fp32"
    assert EngineConfig(dtype="bf16").weight_dtype == "bf16"


def test_the_engine_logs_what_auto_chose(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save_hf_dir(tmp_path, TINY, tiny_weights())
    with caplog.at_level("INFO", logger="engine.engine"):
        engine = Engine.from_path(tmp_path, EngineConfig(dtype="auto", num_blocks=8))
    chosen = engine.config.weight_dtype
    why = auto_dtype_reason(cpu_flags(), has_int8_kernels())
    assert [r.getMessage() for r in caplog.records] == [f"dtype auto -> {chosen} ({why})"]
    caplog.clear()
    with caplog.at_level("INFO", logger="engine.engine"):
        Engine.from_path(tmp_path, EngineConfig(dtype="fp32", num_blocks=8))
    assert caplog.records == []
