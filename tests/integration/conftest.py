from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model_files import default_model_path

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
