"""engine/decode_stack.py: a decode step's layers as one C call give the bits of the same C ops
called layer by layer (engine/fused_forward.py), int8 weights or int4, and it is taken only
where it can be. (An int8
model's speculation, through the stack, against none: test_native.py.)"""

from __future__ import annotations

import pytest
import torch

from engine import native
from engine.decode_stack import DecodeStack
from engine.model import LlamaModel
from engine.sampling_params import SamplingParams
from tests.unit.tiny import TINY, generate_checked, quantized_model, tiny_weights

PROMPTS = [[5, 9, 11], list(range(1, 40)), [7] * 17, [100, 2]]


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("kv_dtype", ["auto", "bf16", "int8"])
@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True, logprobs=3),
], ids=["greedy", "seeded"])  # fmt: skip
def test_the_stack_in_one_call_is_the_layer_by_layer_step_bit_for_bit(
    ops: native.NativeOps, weights: str, kv_dtype: str, params: SamplingParams
) -> None:
    model = quantized_model(weights)
    stack = model.decode_stack
    assert stack is not None and model.native is ops
    results = []
    for s in (stack, None):
        model.decode_stack = s
        results.append(generate_checked(model, PROMPTS, params, kv_dtype=kv_dtype))
    for one_call, by_layer in zip(*results, strict=True):
        assert one_call.token_ids == by_layer.token_ids
        assert [(x.token_id, x.logprob) for x in one_call.logprobs if x] == [
            (x.token_id, x.logprob) for x in by_layer.logprobs if x
        ]


def test_only_a_model_whose_every_projection_has_its_per_row_weight_gets_one(ops: native.NativeOps) -> None:
    assert LlamaModel(TINY, tiny_weights(), torch.float32).decode_stack is None  # fp32 weights
    model = LlamaModel(TINY, tiny_weights(), torch.float32, int8=True)
    assert isinstance(model.decode_stack, DecodeStack)
    model.layers[1].down.rows = None  # as a weight holding -128 leaves it
    assert DecodeStack.of(model) is None
