"""int8 and int4 weights on the real model: the first greedy token against fp32's, on 40 chat
prompts; int4's weights are the file's own.

The first token comes from the prefill. Through fbgemm's dynamic kernel, one activation scale
spans the whole prompt (7 bits of it, reduce_range), and the first token matched fp32's on only
12-13 of these 40 prompts. Quantized per row (engine/csrc/linear_i8.c, where the CPU has
AVX512-VNNI or AVX2), it matched on 30 of 40, with either prefill attention (torch's fp32 kernel or the
bf16 one). The threshold, 24, sits between the two with room for other CPUs' rounding. int4 keeps the
file's Q4_1 weights as they are (so only the activations are rounded, per row, as int8's): 30 of
40 too, on the Zen 1 EPYC where it was written; the same threshold. With the int8 prefill
attention (`auto` where the CPU has AVX512-VNNI), on a Zen 4: int8 30 (torch's kernel 31, bf16 33),
int4 30 (27, 27). On a Zen 5, its blocks of 32 keys: int8 34, int4 29; of 64: 30, 32.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.q4_weight import Q4Weight
from engine.sampling_params import SamplingParams
from engine.weights import load_checkpoint, load_q4_1_blocks

TOPICS = ["the ocean", "a bicycle", "prime numbers", "the French revolution", "photosynthesis", "a haiku", "coffee",
          "Python lists", "the moon", "volcanoes", "chess", "rain", "a recipe for bread", "gravity", "jazz",
          "the Roman empire", "electric cars", "sleep", "birds", "the internet"]  # fmt: skip
FORMS = ["Tell me about {}.", "Write two sentences on {}, then a question about it."]
MIN_FIRST_TOKENS = 24


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_first_tokens_match_fp32s(engine_fp32: Engine, model_path: str, dtype: str) -> None:
    quantized = Engine.from_path(model_path, EngineConfig(dtype=dtype, num_blocks=256))
    if quantized.model.per_row is None:
        pytest.skip("no AVX512-VNNI or AVX2 here: the prefill keeps fbgemm's per-tensor kernel")
    assert (dtype == "int4") == all(p.q4 is not None for lw in quantized.model.layers for p in (lw.qkv, lw.down))
    tok = engine_fp32.tokenizer
    assert tok is not None
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": f.format(t)}])) for f in FORMS for t in TOPICS
    ]
    one = SamplingParams(max_tokens=1, temperature=0)
    want = [r.token_ids for r in engine_fp32.generate(prompts, one)]
    got = [r.token_ids for r in quantized.generate(prompts, one)]
    quantized.check_integrity()
    same = sum(a == b for a, b in zip(got, want, strict=True))
    print(f"{dtype} first token = fp32's on {same} of {len(prompts)} prompts")
    assert same >= MIN_FIRST_TOKENS


def test_int4s_weights_are_the_files_own(model_path: str) -> None:
    """Every Q4_1 layer weight, RoPE rows unpermuted as raw blocks, equals the file's dequantized
    (and unpermuted) floats bit for bit."""
    _, weights = load_checkpoint(model_path)
    blocks = load_q4_1_blocks(model_path)
    assert len(blocks) == 7 * 30  # SmolLM2's q, k, v, o, gate, up, down in each of 30 layers
    for name, rows in blocks.items():
        w = Q4Weight.from_blocks(rows)
        assert w is not None and torch.equal(w.dequantize(), weights[name]), name
