from __future__ import annotations

import pytest
import torch

from engine.model import LlamaModel
from engine.model_files import default_model_path
from engine.tokenizer import Tokenizer
from tests.unit.tiny import TINY, tiny_weights


@pytest.fixture(scope="session")
def tiny_model() -> LlamaModel:
    return LlamaModel(TINY, tiny_weights(), torch.float32)


@pytest.fixture(scope="session")
def smollm_tokenizer() -> Tokenizer:
    """The bundled model's real tokenizer (metadata only, no weights)."""
    return Tokenizer.load(default_model_path())


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model as a checkpoint directory, for workers (they load from a path)."""
    from engine.weights import save_hf_dir

    d = tmp_path_factory.mktemp("tiny")
    save_hf_dir(d, TINY, tiny_weights())
    return str(d)
