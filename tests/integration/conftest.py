from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model_files import default_model_path
from engine.sampling_params import SamplingParams
from tests.integration.reference import NEW_TOKENS, reference_prompts

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def model_path() -> str:
    return str(default_model_path())


@pytest.fixture(scope="session")
def engine_fp32(model_path: str) -> Engine:
    return Engine.from_path(model_path, EngineConfig(dtype="fp32", num_blocks=512))


@pytest.fixture(scope="session")
def hf_model(model_path: str) -> Any:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def fp32_greedy(engine_fp32: Engine) -> list[list[int]]:
    """The fp32 engine's greedy NEW_TOKENS for each reference prompt, in one batch (as served;
    test_batched_real_model_matches_alone holds a batch to each prompt alone)."""
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    answers = [r.token_ids for r in engine_fp32.generate(reference_prompts(engine_fp32), greedy)]
    engine_fp32.check_integrity()
    return answers
