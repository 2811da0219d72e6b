"""Engine profiles (planner/profile.py), the roofline estimator (planner/roofline.py) on hand-
computed figures, the hardware facts kept as data, and a measured profile of the tiny model."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig, ModelConfig
from engine.model import LlamaModel
from planner.hardware import Hardware, known
from planner.measure import QUICK, busy_peer, measure_profile
from planner.profile import DecodePoint, EngineProfile, PrefillPoint, fetch, redis_key, store
from planner.roofline import ModelShape, decode_seconds, estimate, prefill_seconds, relative_errors
from tests.unit.tiny import make_engine

# 2 layers, hidden 8, 2 heads of 4 (q 8), 1 KV head (kv 4), intermediate 16, vocab 10
TOY = ModelConfig(10, 8, 16, 2, 2, 1, 4, 1e4, 1e-5, 64, True)
HW = Hardware("toy", {"fp32": 1e6}, mem_bw=1e4, mem_bytes=1e9, step_overhead_s=0.5)


def test_model_shape_by_hand() -> None:
    m = ModelShape.of(TOY, "fp32", "int8")
    per_layer = 8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16  # qkv + o + gate/up/down = 576
    assert m.projection_params == 2 * per_layer and m.head_params == 80
    assert m.weight_bytes == (2 * per_layer + 80) * 4
    assert m.kv_bytes_per_token == 2 * 2 * 1 * (4 * 1 + 4)  # layers x K/V x heads x (codes + scale)


def test_roofline_takes_the_slower_of_flops_and_bytes_plus_the_step_cost() -> None:
    m = ModelShape.of(TOY, "fp32", "fp32")  # weights 4928 B, KV 2 layers x K/V x 4 x 4 B = 64 B a token
    # prefill 10 after 0: FLOPs 2*1152*10 + 160 + 4*2*8*(0 + 50) = 26400 -> 26.4 ms; bytes 4928 + 640 -> 556.8 ms
    assert prefill_seconds(m, HW, "fp32", 10, 0) == pytest.approx(0.5 + 0.5568)
    # decode batch 4, context 100: FLOPs 4*(2304 + 160) + 4*2*8*100 = 16256 -> 16.3 ms; bytes 4928 + 6400 -> 1132.8 ms
    assert decode_seconds(m, HW, "fp32", 4, 100) == pytest.approx(0.5 + 1.1328)
    fast_memory = Hardware("toy", {"fp32": 1e6}, mem_bw=1e9, mem_bytes=1e9)
    assert decode_seconds(m, fast_memory, "fp32", 4, 100) == pytest.approx(16256 / 1e6)  # compute-bound


def profile(**kw: Any) -> EngineProfile:
    base: dict[str, Any] = dict(
        node_class="n", source="measured", model="m", dtype="fp32", kv_dtype="fp32",
        prefill=(PrefillPoint(10, 0, 2.0),), decode=(DecodePoint(4, 100, 1.0),), transfer_gbps={"grpc": 0.8},
    )  # fmt: skip
    return EngineProfile(**(base | kw))


def test_estimate_covers_the_measured_points_and_errors_are_relative() -> None:
    est = estimate(profile(), TOY, HW, "fp32", node_class="toy-node")
    assert est.source == "roofline:toy" and est.node_class == "toy-node"
    assert [(p.uncached, p.cached) for p in est.prefill] == [(10, 0)]
    assert relative_errors(est, profile()) == pytest.approx([abs(1.0568 - 2.0) / 2.0, abs(1.6328 - 1.0) / 1.0])


class DictStore:
    """The KeyValue boundary (a redis.Redis in production)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, name: str, value: str) -> None:
        self.data[name] = value.encode()

    def get(self, name: str) -> bytes | None:
        return self.data.get(name)


def test_profiles_round_trip_as_json_and_through_the_store(tmp_path: Any) -> None:
    p = profile()
    p.save(tmp_path / "p.json")
    assert EngineProfile.load(tmp_path / "p.json") == p
    kv = DictStore()
    store(kv, "ns", p)
    assert list(kv.data) == [redis_key("ns", "n")] and fetch(kv, "ns", "n") == p
    assert fetch(kv, "ns", "other") is None


def test_h100_and_h200_facts_are_data() -> None:
    hw = known()
    assert hw["H200-SXM"].mem_bw > hw["H100-SXM"].mem_bw and hw["H200-SXM"].mem_bytes == 141e9
    assert hw["H100-SXM"].flops("fp16") == hw["H100-SXM"].peak_flops["bf16"]


def test_a_measured_profile_of_the_tiny_model(tiny_model: LlamaModel) -> None:
    engine = make_engine(tiny_model, num_blocks=256)
    p = measure_profile(engine, QUICK, "tiny-node", "tiny")
    assert [(x.uncached, x.cached) for x in p.prefill] == list(QUICK.prefill)
    assert [x.batch for x in p.decode] == [b for b, _ in QUICK.decode]
    assert all(x.seconds > 0 for x in (*p.prefill, *p.decode))
    assert p.source == "measured" and p.dtype == "fp32" and p.kv_dtype == "fp32"
    engine.check_integrity()
    assert engine.kv.num_requests == 0


def test_hardware_nodes_hold_the_kv_cache_the_engine_would_there() -> None:
    """`auto` on a GPU is what engine/kv_codec.py makes of it for that weight dtype's activations
    (bf16 under int8 and fp8 weights, not the weights' own one byte), and it sets the room."""
    import torch

    from engine.kv_codec import KVCodec
    from planner.kinds import from_hardware, model_config
    from planner.roofline import gpu_kv_dtype

    for dtype, compute in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("int8", torch.bfloat16),
                           ("fp8", torch.bfloat16)):  # fmt: skip
        assert gpu_kv_dtype(dtype) == KVCodec.of("auto", compute, quantized=dtype in ("int8", "fp8")).kind
    assert gpu_kv_dtype("int8", "int8") == "int8"
    config, h100 = model_config("llama-3.1-8b"), known()["H100-SXM"]
    auto = from_hardware(h100, config, "llama-3.1-8b", "int8", gpu_kv_dtype("int8"), 0.0, 1)
    coded = from_hardware(h100, config, "llama-3.1-8b", "int8", "int8", 0.0, 1)
    assert auto.worker.kv_tokens < 0.6 * coded.worker.kv_tokens  # 2 bytes a value against 1 and a scale a row


def test_a_busy_peer_that_cannot_start_is_an_error_and_leaves_no_process(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="before it decoded"), busy_peer(str(tmp_path / "m.gguf"), EngineConfig()):
        pass
    assert not multiprocessing.active_children()
