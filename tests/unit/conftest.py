from __future__ import annotations

import os
import shutil

import pytest
import torch

from engine import native
from engine.model import LlamaModel
from engine.model_files import default_model_path
from engine.tokenizer import Tokenizer
from tests.unit.tiny import TINY, tiny_weights

HAS_CC = shutil.which(os.environ.get("CC", "cc")) is not None


@pytest.fixture(scope="module")
def ops() -> native.NativeOps:
    """The built C ops (engine/native.py)."""
    if not HAS_CC:
        pytest.skip("no C compiler: the engine runs its torch ops (tested in test_native.py)")
    built = native.ops()
    assert built is not None, "a C compiler is here, so the library must build"
    return built


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
