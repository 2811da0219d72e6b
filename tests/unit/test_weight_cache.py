"""The prepared-weights cache: a cached load equals a fresh one bit for bit, and a bad entry
is rebuilt, a changed checkpoint gets a new entry, an unwritable place falls back."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine.attention import AttentionMetadata, PrefillChunk
from engine.model import LlamaModel
from engine.paged_cache import PagedKVCache
from engine.weight_cache import load_model
from engine.weights import save_hf_dir
from tests.unit.tiny import TINY, tiny_weights

IDS = torch.tensor([5, 17, 99, 3, 3, 64, 127, 0, 42, 8])


def logits(model: LlamaModel) -> torch.Tensor:
    n = len(IDS)
    cache = PagedKVCache(model.config, 4, 4, model.dtype)
    meta = AttentionMetadata(torch.arange(n), 0, None, None, (PrefillChunk(0, n, 0, torch.arange(3)),))
    return model.forward(IDS, torch.arange(n), cache, meta, torch.arange(n))


@pytest.fixture
def checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    save_hf_dir(tmp_path / "model", TINY, tiny_weights(5))
    return tmp_path / "model"


def entries(d: Path) -> list[Path]:
    return sorted(d.rglob("*.pt"))


@pytest.mark.parametrize(
    ("dtype", "name"), [(torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float32, "int8")]
)
def test_a_cached_load_equals_a_fresh_one_bit_for_bit(
    checkpoint: Path, dtype: torch.dtype, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    fresh = logits(load_model(checkpoint, dtype, name, use_cache=False))
    assert entries(checkpoint) == []
    with caplog.at_level(logging.INFO, "engine.weight_cache"):
        first = logits(load_model(checkpoint, dtype, name))
        [entry] = entries(checkpoint / ".tandem")
        written = entry.stat().st_mtime_ns
        caplog.clear()
        second = logits(load_model(checkpoint, dtype, name))
    assert entry.stat().st_mtime_ns == written and "cached" not in caplog.text  # read, not rebuilt
    assert torch.equal(first, fresh) and torch.equal(second, fresh)


def test_an_unreadable_entry_is_rebuilt(checkpoint: Path, caplog: pytest.LogCaptureFixture) -> None:
    expected = logits(load_model(checkpoint, torch.float32, "int8"))
    [entry] = entries(checkpoint / ".tandem")
    entry.write_bytes(entry.read_bytes()[:1000])  # truncated, as by a crash mid-copy
    assert torch.equal(logits(load_model(checkpoint, torch.float32, "int8")), expected)
    assert "unreadable" in caplog.text
    assert entries(checkpoint / ".tandem") == [entry] and entry.stat().st_size > 1000


def test_a_changed_checkpoint_gets_a_new_entry_and_the_old_one_goes(checkpoint: Path) -> None:
    load_model(checkpoint, torch.float32, "fp32")
    [old] = entries(checkpoint / ".tandem")
    save_hf_dir(checkpoint, TINY, tiny_weights(6))
    model = load_model(checkpoint, torch.float32, "fp32")
    [new] = entries(checkpoint / ".tandem")
    assert new != old
    assert torch.equal(logits(model), logits(load_model(checkpoint, torch.float32, "fp32", use_cache=False)))


def test_where_the_checkpoint_dir_cannot_hold_it_the_user_cache_does(checkpoint: Path, tmp_path: Path) -> None:
    (checkpoint / ".tandem").write_text("a file where the cache directory would go")
    expected = logits(load_model(checkpoint, torch.float32, "fp32"))
    [entry] = entries(tmp_path / "xdg")
    assert entry.is_relative_to(tmp_path / "xdg" / "tandem" / "weights")
    assert torch.equal(logits(load_model(checkpoint, torch.float32, "fp32")), expected)
