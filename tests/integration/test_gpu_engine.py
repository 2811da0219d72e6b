"""The engine on CUDA (issue 16), behind the `gpu` marker: `make test-gpu` runs it on a machine
with a GPU and a CUDA torch wheel; without one it is skipped, and says so.

- greedy on CUDA in bf16 equals HF transformers on the same GPU in bf16, 8 prompts x 64 tokens
  (a divergence only at a near-tie of HF's top two logits, as the CPU reference test allows);
- CUDA graphs on give the tokens of CUDA graphs off, for a batch of 8;
- a cache sized from the GPU's free memory (`num_blocks` None) holds its share and answers alike.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_budget import GPU_SHARE
from engine.model_files import default_model_path
from engine.sampling_params import SamplingParams
from tests.integration.reference import CHAT, RAW
from tests.integration.test_long_context import hf_greedy_gaps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NEW_TOKENS = 64
PROMPTS = CHAT[:4] + RAW[:4]
NEAR_TIE = 0.125  # bf16 logits: HF's top-2 gap under which the two may pick differently


@pytest.fixture(scope="module")
def gpu_engine(model_path: str) -> Engine:
    return Engine.from_path(model_path, EngineConfig(dtype="bf16", device="cuda", num_blocks=1024))


def prompt_ids(engine: Engine, i: int) -> list[int]:
    tok = engine.tokenizer
    assert tok is not None
    text = PROMPTS[i]
    if i < 4:
        text = tok.apply_chat_template([{"role": "user", "content": text}])
    return tok.encode(text)


def test_greedy_matches_hf_on_the_same_gpu(gpu_engine: Engine) -> None:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16)
    hf = hf.to("cuda").eval()
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for i in range(len(PROMPTS)):
        ids = prompt_ids(gpu_engine, i)
        ours = gpu_engine.generate([ids], greedy)[0].token_ids
        theirs, gaps = hf_greedy_gaps(hf, ids, NEW_TOKENS, device="cuda")
        first = next((j for j, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
        assert first is None or gaps[first] < NEAR_TIE, (i, first, gaps[first] if first is not None else None)
    gpu_engine.check_integrity()


def test_cuda_graphs_give_the_eager_tokens(gpu_engine: Engine) -> None:
    eager = Engine(gpu_engine.model, gpu_engine.tokenizer, EngineConfig(dtype="bf16", device="cuda", cuda_graphs=False))
    prompts = [prompt_ids(gpu_engine, i) for i in range(len(PROMPTS))]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    graphed = [o.token_ids for o in gpu_engine.generate(prompts, greedy)]
    assert gpu_engine.runner.graphs is not None and gpu_engine.runner.graphs.captured()
    assert [o.token_ids for o in eager.generate(prompts, greedy)] == graphed
    for e in (gpu_engine, eager):
        e.check_integrity()


def test_a_cache_sized_from_memory_takes_its_share_of_the_gpu(gpu_engine: Engine) -> None:
    """num_blocks None on CUDA: GPU_SHARE of the device's free memory (engine/kv_budget.py), and
    the tokens of a fixed-size cache."""
    free, _ = torch.cuda.mem_get_info()
    auto = Engine(gpu_engine.model, gpu_engine.tokenizer, EngineConfig(dtype="bf16", device="cuda", num_blocks=None))
    try:
        assert auto.config.num_blocks is not None
        held = auto.config.num_blocks * auto.cache.bytes_per_block
        assert 0.5 * free <= held <= GPU_SHARE * free, (held, free)
        prompts = [prompt_ids(gpu_engine, i) for i in range(2)]
        greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        assert [r.token_ids for r in auto.generate(prompts, greedy)] == [
            r.token_ids for r in gpu_engine.generate(prompts, greedy)
        ]
        auto.check_integrity()
    finally:
        del auto
        torch.cuda.empty_cache()
