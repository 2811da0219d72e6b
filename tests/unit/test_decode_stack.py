"""engine/decode_stack.py: a decode step's layers as one C call give the bits of the same C ops
called layer by layer (engine/fused_forward.py), and it is taken only where it can be."""

from __future__ import annotations

import pytest
import torch

from engine import native
from engine.decode_stack import DecodeStack
from engine.model import LlamaModel
from engine.sampling_params import SamplingParams
from tests.unit.tiny import TINY, make_engine, tiny_weights

PROMPTS = [[5, 9, 11], list(range(1, 40)), [7] * 17, [100, 2]]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True, logprobs=3),
], ids=["greedy", "seeded"])  # fmt: skip
def test_the_stack_in_one_call_is_the_layer_by_layer_step_bit_for_bit(
    ops: native.NativeOps, kv_dtype: str, params: SamplingParams
) -> None:
    model = LlamaModel(TINY, tiny_weights(), torch.float32, int8=True)
    stack = model.decode_stack
    assert stack is not None and model.native is ops
    results = []
    for s in (stack, None):
        model.decode_stack = s
        engine = make_engine(model, num_blocks=128, kv_dtype=kv_dtype)
        results.append(engine.generate(PROMPTS, params) + engine.generate(PROMPTS[1:2], params))
        engine.check_integrity()
    for one_call, by_layer in zip(*results, strict=True):
        assert one_call.token_ids == by_layer.token_ids
        assert [(x.token_id, x.logprob) for x in one_call.logprobs if x] == [
            (x.token_id, x.logprob) for x in by_layer.logprobs if x
        ]


def test_speculation_over_the_stack_gives_the_tokens_of_no_speculation(ops: native.NativeOps) -> None:
    """A verify step's draft rows are decode rows of the same stack call."""
    model = LlamaModel(TINY, tiny_weights(), torch.float32, int8=True)
    assert model.decode_stack is not None
    looping = [([(7 * i + 3 * j) % 120 + 1 for j in range(5)] * 6)[: 12 + 5 * i] for i in range(4)]
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True, logprobs=2)
    off = make_engine(model, num_blocks=128).generate(looping, params)
    spec = make_engine(model, num_blocks=128, speculative="ngram")
    on = spec.generate(looping, params)
    spec.check_integrity()
    assert spec.speculator is not None and spec.speculator.accepted > 0
    for a, b in zip(on, off, strict=True):
        assert a.token_ids == b.token_ids
        assert [(x.token_id, x.logprob) for x in a.logprobs if x] == [(x.token_id, x.logprob) for x in b.logprobs if x]


def test_only_a_model_whose_every_projection_has_its_per_row_weight_gets_one(ops: native.NativeOps) -> None:
    assert LlamaModel(TINY, tiny_weights(), torch.float32).decode_stack is None  # fp32 weights
    model = LlamaModel(TINY, tiny_weights(), torch.float32, int8=True)
    assert isinstance(model.decode_stack, DecodeStack)
    model.layers[1].down.rows = None  # as a weight holding -128 leaves it
    assert DecodeStack.of(model) is None
