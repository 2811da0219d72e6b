from __future__ import annotations

import pytest
import torch

from engine.model import LlamaModel
from tests.unit.tiny import TINY, tiny_weights


@pytest.fixture(scope="session")
def tiny_model() -> LlamaModel:
    return LlamaModel(TINY, tiny_weights(), torch.float32)
