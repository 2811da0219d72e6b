"""Checkpoint loading: HF safetensors directories, GGUF headers, RoPE un-permutation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.attention import AttentionMetadata, PrefillChunk
from engine.gguf_file import GGUFFile
from engine.model import LlamaModel
from engine.model_files import default_model_path
from engine.paged_cache import PagedKVCache
from engine.weights import _unpermute_rope, load_checkpoint, save_hf_dir
from tests.unit.tiny import TINY, tiny_weights


def test_hf_dir_round_trip(tmp_path: Path) -> None:
    w = tiny_weights(3)
    save_hf_dir(tmp_path, TINY, w)
    config, loaded = load_checkpoint(tmp_path)
    assert config == TINY
    assert loaded.keys() == w.keys()
    for k in w:
        assert torch.equal(loaded[k], w[k]), k


def test_tiny_model_matches_hf_transformers(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    save_hf_dir(tmp_path, TINY, tiny_weights(4))
    config, weights = load_checkpoint(tmp_path)
    ours = LlamaModel(config, weights, torch.float32)
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    ids = torch.tensor([5, 17, 99, 3, 3, 64, 127, 0, 42, 8, 8, 8, 19])
    n = len(ids)
    cache = PagedKVCache(config, 4, 4, torch.float32)
    meta = AttentionMetadata(torch.arange(n), 0, None, None, (PrefillChunk(0, n, 0, torch.arange(4)),))
    got = ours.forward(ids, torch.arange(n), cache, meta, torch.arange(n))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (got - ref).abs().max().item() < 1e-4


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # What convert_hf_to_gguf.py does to q/k rows.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    for heads in (1, 3, 6):
        assert np.array_equal(_unpermute_rope(_llama_cpp_permute(w, heads), heads), w)


def test_gguf_header_of_the_bundled_model() -> None:
    gf = GGUFFile(default_model_path())
    assert gf.fields["general.architecture"] == "llama"
    assert gf.fields["llama.block_count"] == 30
    assert len(gf.fields["tokenizer.ggml.tokens"]) == 49152
    names = {t.name: t for t in gf.tensors}
    assert len(names) == 272 and "output.weight" not in names
    assert names["blk.0.ffn_down.weight"].shape == (576, 1536)
    assert gf.dequantize(names["blk.0.attn_norm.weight"]).shape == (576,)
