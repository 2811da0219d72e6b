"""The engine on a device of its config's choosing (issue 16), proven on CPU with the meta
device: every tensor a step creates must name its device, or the step raises."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model import LlamaModel
from engine.penalties import SeenTokens
from engine.sampler import SamplerOutput
from engine.sampling_params import SamplingParams
from tests.unit.tiny import TINY, tiny_weights

FACTORIES = {
    torch.tensor, torch.as_tensor, torch.empty, torch.zeros, torch.ones, torch.full, torch.arange,
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace, torch.eye,
}  # fmt: skip


class DeviceLeaks(TorchFunctionMode):
    """Raises on a tensor created without an explicit device (it would land on the CPU)."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            raise AssertionError(f"torch.{func.__name__} without a device")
        return func(*args, **kwargs)


class ShapesOnly:
    """The sampler's place on the meta device, where no logit has a value: checks what it is
    given and picks token 7 for every row."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        index: Sequence[int],
        seen: Sequence[SeenTokens | None],
        allowed: torch.Tensor | None,
    ) -> SamplerOutput:
        assert logits.device.type == "meta" and logits.shape == (len(params), TINY.vocab_size)
        assert len(seen) == len(params) and allowed is None
        self.rows.append(len(params))
        return SamplerOutput([7] * len(params), [None] * len(params))


def test_the_leak_guard_catches_a_tensor_made_without_a_device() -> None:
    with DeviceLeaks(), pytest.raises(AssertionError, match=r"torch.zeros without a device"):
        torch.zeros(3)
    with DeviceLeaks():
        assert torch.zeros(3, device="meta").device.type == "meta"


def test_a_whole_batch_runs_on_the_meta_device_with_no_tensor_off_it() -> None:
    model = LlamaModel(TINY, tiny_weights(), torch.float32).to("meta")
    config = EngineConfig(dtype="fp32", block_size=4, num_blocks=64, max_num_batched_tokens=16, device="meta")
    engine = Engine(model, None, config)
    assert engine.cache.kv.device.type == "meta"
    sampler = ShapesOnly()
    engine.runner.sampler = sampler
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    long_prompt = list(range(1, 25))  # 24 tokens: chunked (16 a step), its second chunk after cached context
    with DeviceLeaks():
        engine.add_request("short", [1, 2, 3, 4, 5, 6], params)
        engine.add_request("long", long_prompt, params)
        steps = 0
        while engine.has_unfinished():
            engine.step()
            engine.check_integrity()
            steps += 1
            if steps == 2:  # a prefix-cache hit: its prefill attends to cached blocks
                engine.add_request("again", long_prompt, params)
    assert steps >= 5
    # decodes beside prefill chunks, then decodes alone
    assert max(sampler.rows) >= 2 and sum(sampler.rows) == 3 * 4
    assert engine.kv.num_free_blocks == config.num_blocks  # every block back (the prompts stay cached)


def test_device_config() -> None:
    assert EngineConfig(device="auto").torch_device == torch.device("cpu")  # the CPU wheel sees no GPU
    cuda = EngineConfig(device="cuda:1")
    assert cuda.torch_device == torch.device("cuda", 1)
    assert cuda.weight_dtype == "bf16" and EngineConfig(device="cuda", dtype="int8").weight_dtype == "bf16"
    assert EngineConfig(device="cuda", dtype="fp32").weight_dtype == "fp32"
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device="tpu")


def test_int8_weights_stay_on_the_cpu_and_a_model_must_match_its_engine() -> None:
    int8 = LlamaModel(TINY, tiny_weights(), torch.float32, int8=True)
    with pytest.raises(ValueError, match="CPU only"):
        int8.to("meta")
    assert int8.to("cpu").device.type == "cpu"
    with pytest.raises(ValueError, match="the model is on cpu"):
        Engine(int8, None, EngineConfig(dtype="fp32", device="meta"))


def test_a_worker_claims_a_gpu_only_for_cuda_and_names_its_device() -> None:
    from engine.worker_base import device_label

    assert EngineConfig(device="cuda").num_gpus == 1 and EngineConfig(device="cuda:1").num_gpus == 1
    assert EngineConfig().num_gpus == 0 and EngineConfig(device="auto").num_gpus == 0
    assert device_label(torch.device("cpu")) == f"cpu, {torch.get_num_threads()} threads"


def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    from engine.model_files import default_model_path

    with pytest.raises(ValueError, match="torch sees no GPU"):
        Engine.from_path(default_model_path(), EngineConfig(device="cuda"))
