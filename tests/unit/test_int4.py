"""int4: the layers' weights as a GGUF file's Q4_1 blocks (engine/q4_weight.py), multiplied by
engine/csrc/linear_q4.c with the activations quantized per row. The blocks are the file's values
exactly; the AVX2 tiles and the plain loops give the same bits; a model in int4 reloads from its
state. (Its one-call stack: test_decode_stack.py; speculation and batching leaving its tokens as
they are: test_native.py, as int8's; the real model: tests/integration/test_int8_quality.py.)"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import native, native_build
from engine.linear import cpu_flags
from engine.model import LlamaModel
from engine.q4_weight import Q4Weight
from engine.sampling_params import SamplingParams
from engine.weight_cache import load_model
from engine.weights import save_hf_dir
from tests.unit.tiny import TINY, generate_checked, quantized_model, tiny_weights


def random_blocks(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Q4_1 rows [n, k / 32 * 20] with random fp16 scales and minima and random nibbles."""
    gen = torch.Generator().manual_seed(seed)
    dm = (torch.randn(n, k // 32, 2, generator=gen) * 0.01).half().view(torch.uint8).view(n, k // 32, 4)
    nibbles = torch.randint(0, 256, (n, k // 32, 16), generator=gen, dtype=torch.uint8)
    return torch.cat([dm, nibbles], dim=-1).reshape(n, -1)


def test_the_blocks_are_the_files_weights_exactly() -> None:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    blocks = random_blocks(48, 96)
    w = Q4Weight.from_blocks(blocks)
    assert w is not None and (w.out_features, w.in_features) == (48, 96)
    files = dequantize(blocks.numpy(), GGMLQuantizationType.Q4_1).reshape(48, 96)
    assert torch.equal(w.dequantize(), torch.from_numpy(np.asarray(files, dtype=np.float32)))
    again = Q4Weight.from_state(w.packed, w.dm)
    assert torch.equal(again.dequantize(), w.dequantize())


def test_a_shape_the_kernel_does_not_tile_has_no_4_bit_weight() -> None:
    assert Q4Weight.from_blocks(random_blocks(24, 64)) is None  # out % 16
    model = LlamaModel(TINY, tiny_weights(), torch.float32, int4={})  # no blocks: int8 layers
    assert all(p.q4 is None and p.int8 for p in model.projections())


def reference(x: torch.Tensor, w: Q4Weight) -> torch.Tensor:
    """x quantized per row as the kernel does, times W, in float64."""
    scale = x.abs().amax(dim=1, keepdim=True) / 127
    xq = torch.where(scale > 0, x / scale, 0).round()
    return (xq.double() @ w.dequantize().double().T) * scale.double()


def test_the_product_is_the_per_row_quantized_one(ops: native.NativeOps) -> None:
    w = Q4Weight.from_blocks(random_blocks(64, 128, seed=1))
    assert w is not None
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 2, 3, 17, 40):  # 1-2 row tiles; 16 rows and more quantize on the threads
        x = torch.randn(rows, 128, generator=gen) * 3
        x[0] = 0  # a zero row: scale 0, output 0
        got = ops.linear_q4(x, w)
        torch.testing.assert_close(got.double(), reference(x, w), atol=1e-5, rtol=1e-5)
        assert not got[0].any()


@pytest.mark.parametrize("without", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")], ids=["avx2", "plain"])
def test_every_path_gives_the_same_bits(ops: native.NativeOps, tmp_path: Path, without: tuple[str, ...]) -> None:
    """Each channel's sum runs the same fused multiply-adds in the same order on every path: this
    CPU's (AVX512-VNNI's tiles where it has them) against AVX2's tiles and the plain loops."""
    path = native_build.build(tmp_path, os.environ.get("CC", "cc"), (*native_build.FLAGS, *without))
    plain = native.NativeOps(ctypes.CDLL(str(path)))
    flags = cpu_flags()
    avx2 = {"avx2", "fma"} <= flags
    assert plain.linear_q4_fast == (avx2 and "-mno-avx2" not in without)
    assert ops.linear_q4_fast == (avx2 or {"avx512_vnni", "avx512bw"} <= flags)
    gen = torch.Generator().manual_seed(5)
    for n, k in ((48, 64), (32, 192)):
        w = Q4Weight.from_blocks(random_blocks(n, k, seed=n))
        assert w is not None
        for rows in (1, 2, 3, 4, 5, 6, 9, 37):  # VNNI's tiles of 1-4 rows, AVX2's of 1-2
            x = torch.randn(rows, k, generator=gen) * 2
            assert torch.equal(plain.linear_q4(x, w), ops.linear_q4(x, w))


def test_an_int4_model_keeps_its_layers_in_4_bits_and_its_lm_head_int8(ops: native.NativeOps) -> None:
    model = quantized_model("int4")
    layers = [p for lw in model.layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down)]
    assert all(p.q4 is not None and p.rows is None for p in layers)
    assert model.lm_head is not None and model.lm_head.int8
    assert model.decode_stack is not None and model.native is ops


def test_it_reloads_from_its_state_and_runs_without_the_c_ops(
    ops: native.NativeOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = quantized_model("int4")
    state = model.state()
    assert "layers.0.qkv.q4_packed" in state and "layers.0.qkv.qweight" not in state
    again = LlamaModel.from_state(TINY, state, torch.float32)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [[5, 9, 11], list(range(1, 30))]
    a, b = generate_checked(model, prompts, params), generate_checked(again, prompts, params)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    p = model.layers[0].gate_up
    assert p.q4 is not None
    x = torch.randn(3, TINY.hidden_size)
    exact = x @ p.q4.dequantize().T
    assert torch.equal(p(x), ops.linear_q4(x, p.q4))  # through the C kernel, as the fused steps
    torch.testing.assert_close(p(x), exact, atol=0.05 * float(exact.abs().max()), rtol=0)  # int8 rows
    with pytest.raises(ValueError, match="CPU only"):
        p.to(torch.device("meta"))
    monkeypatch.setenv("TANDEM_NATIVE", "0")  # no C ops: W in fp32, d * q + m
    native.ops.cache_clear()
    try:
        assert native.ops() is None
        torch.testing.assert_close(p(x), exact)
    finally:
        monkeypatch.undo()
        native.ops.cache_clear()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # fbgemm, the fallback here
def test_a_checkpoint_without_q4_1_blocks_or_without_the_c_ops_runs_int8(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    save_hf_dir(tmp_path, TINY, tiny_weights())  # safetensors: nothing 4-bit to keep
    with caplog.at_level("INFO", logger="engine.weight_cache"):
        model = load_model(tmp_path, torch.float32, "int4", use_cache=False)
    assert all(p.q4 is None and p.int8 for p in model.projections())
    assert "has no Q4_1 blocks to keep" in caplog.text
    monkeypatch.setenv("TANDEM_NATIVE", "0")
    native.ops.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="engine.weight_cache"):
            load_model(tmp_path, torch.float32, "int4", use_cache=False)
        assert "int4 runs on the C kernels" in caplog.text
    finally:
        monkeypatch.undo()
        native.ops.cache_clear()
