"""The model's prepared weights, cached beside the checkpoint: a reload skips dequantizing
the GGUF and quantizing to int8 (measured: 2.7 s -> see the README's load-time row).

An entry is keyed by the sha256 of the checkpoint's bytes, the dtype and FORMAT, and lives
in `<file>.tandem/` beside a GGUF file or `<dir>/.tandem/` inside an HF directory; where that
cannot be written, in `$XDG_CACHE_HOME/tandem/weights/<hash>/` (default ~/.cache). Entries
are written to a temporary file and renamed, so workers starting together on one node never
read a half-written one; an unreadable entry is logged, removed and rebuilt. Entries are read
with mmap: float weights stay in the page cache, shared by every worker on the node.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.model import LlamaModel
from engine.model_files import checkpoint_kind
from engine.native import ops
from engine.weights import load_checkpoint, load_q4_1_blocks

log = logging.getLogger(__name__)

FORMAT = 1


def checkpoint_files(path: Path) -> list[Path]:
    """The files whose bytes define a checkpoint: a GGUF file, or config.json and the shards.
    FileNotFoundError for a path that holds neither (engine/model_files.py)."""
    if checkpoint_kind(path) == "gguf":
        return [path]
    return [path / "config.json", *sorted(path.glob("*.safetensors"))]


def checkpoint_hash(path: Path) -> str:
    h = hashlib.sha256()
    for f in checkpoint_files(path):
        with open(f, "rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
    return h.hexdigest()


def cache_dirs(path: Path, digest: str) -> list[Path]:
    """Where entries for this checkpoint go, in order of preference."""
    beside = path.with_name(path.name + ".tandem") if path.is_file() else path / ".tandem"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return [beside, base / "tandem" / "weights" / digest[:24]]


def load_model(path: str | Path, dtype: torch.dtype, dtype_name: str, use_cache: bool = True) -> LlamaModel:
    """The model at `path` in `dtype` (`dtype_name` "int8": int8 projections; "int4": 4-bit ones,
    the file's own Q4_1 blocks where it has them), from the cache when it has an entry, else
    from the checkpoint (and then cached)."""
    p = Path(path)
    if dtype_name == "int4" and ops() is None:
        log.warning("int4 runs on the C kernels (engine/native.py), unavailable here: the layers run int8")
        dtype_name = "int8"
    if not use_cache:
        return _convert(p, dtype, dtype_name)
    digest = checkpoint_hash(p)
    name = f"{digest[:24]}-{dtype_name}-v{FORMAT}.pt"
    dirs = cache_dirs(p, digest)
    for d in dirs:
        if (d / name).is_file():
            model = _read(d / name, dtype)
            if model is not None:
                return model
    model = _convert(p, dtype, dtype_name)
    _write(model, dirs, name, digest[:24])
    return model


def _convert(path: Path, dtype: torch.dtype, dtype_name: str) -> LlamaModel:
    config, weights = load_checkpoint(path)
    int4 = load_q4_1_blocks(path) if dtype_name == "int4" else None
    if int4 == {}:
        log.info("%s has no Q4_1 blocks to keep: int4 runs its layers in int8", path)
    return LlamaModel(config, weights, dtype, dtype_name in ("int8", "int4"), int4 or None)


def _read(entry: Path, dtype: torch.dtype) -> LlamaModel | None:
    try:
        blob = torch.load(entry, mmap=True, weights_only=True)
        if blob.get("format") != FORMAT:
            raise ValueError(f"format {blob.get('format')!r}, expected {FORMAT}")
        return LlamaModel.from_state(ModelConfig(**blob["config"]), blob["tensors"], dtype)
    except Exception as e:  # a truncated or foreign file: whatever torch.load raises for it
        log.warning("weight cache entry %s is unreadable (%s); rebuilding it", entry, e)
        entry.unlink(missing_ok=True)
        return None


def _write(model: LlamaModel, dirs: list[Path], name: str, digest: str) -> None:
    blob = {"format": FORMAT, "config": dataclasses.asdict(model.config), "tensors": model.state()}
    for d in dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
            for stale in d.glob("*.pt"):  # entries of an older version of this checkpoint
                if not stale.name.startswith(digest):
                    stale.unlink(missing_ok=True)
            fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
        except OSError as e:
            log.info("cannot cache weights in %s (%s)", d, e)
            continue
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(blob, f)
            os.chmod(tmp, 0o644)  # every worker on the node may read it, as it may the model
            os.replace(tmp, d / name)
            log.info("cached prepared weights in %s", d / name)
            return
        except OSError as e:
            Path(tmp).unlink(missing_ok=True)
            log.info("cannot cache weights in %s (%s)", d, e)
    log.warning("no writable place to cache weights; every load will convert them again")
