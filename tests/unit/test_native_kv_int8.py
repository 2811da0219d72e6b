"""The fused decode step over an int8 KV cache (engine/csrc/attention.c, rope_write's coding):
the codes it writes are engine/kv_codec.py's, bit for bit, and its attention over them is the
attention over their decoded values. (The model's decode through it against its torch ops:
test_native.py, with kv_dtype int8.)"""

from __future__ import annotations

import pytest
import torch

from engine import native
from engine.kv_codec import KVCodec
from engine.model import LlamaModel
from tests.unit.test_paged_decode import dense_reference, random_tables
from tests.unit.tiny import TINY, tiny_weights

CODEC = KVCodec.of("int8", torch.float32)


def test_rope_write_codes_the_kv_as_the_codec_does(ops: native.NativeOps) -> None:
    model = LlamaModel(TINY, tiny_weights(), torch.float32)
    nh, nkv, d = TINY.num_heads, TINY.num_kv_heads, TINY.head_dim
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(5, TINY.q_size + 2 * TINY.kv_size, generator=gen) * torch.logspace(-4, 2, 5)[:, None]
    qkv[2, TINY.q_size + TINY.kv_size :] = 0.0  # a zero value row: scale 1e-12 / 127, codes 0
    positions, slots = torch.tensor([0, 3, 9, 200, 511]), torch.tensor([4, 0, 31, 7, 12])
    v = qkv[:, TINY.q_size + TINY.kv_size :].reshape(5, nkv, d).clone()
    k_cache = torch.zeros(32, nkv, CODEC.width(d), dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    ops.rope_write(qkv, nh, nkv, positions, model.cos, model.sin, slots, k_cache, v_cache)
    k = qkv[:, TINY.q_size : TINY.q_size + TINY.kv_size].reshape(5, nkv, d)  # roped in place
    assert torch.equal(k_cache[slots], CODEC.encode(k)) and torch.equal(v_cache[slots], CODEC.encode(v))
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize("lens", [[1], [5, 16, 17], [300, 7, 129, 64], [1537, 512, 513]])
@pytest.mark.parametrize("shape", [(9, 3, 64), (12, 2, 128), (4, 2, 16)])
def test_attention_over_int8_codes_is_attention_over_their_values(
    ops: native.NativeOps,
    lens: list[int],
    shape: tuple[int, int, int],
) -> None:
    gen = torch.Generator().manual_seed(len(lens) * 7 + sum(lens))
    bs, num_blocks = 16, 128
    nh, nkv, d = shape
    k_cache = CODEC.encode(torch.randn(num_blocks * bs, nkv, d, generator=gen))
    v_cache = CODEC.encode(torch.randn(num_blocks * bs, nkv, d, generator=gen) * 3)
    qkv = torch.randn(len(lens), (nh + 2 * nkv) * d, generator=gen)
    tables = random_tables(gen, lens, num_blocks, bs)
    got = ops.decode_attention(qkv, nh, k_cache, v_cache, torch.tensor(tables), torch.tensor(lens), bs)
    q = qkv[:, : nh * d].reshape(len(lens), nh, d)
    expected = dense_reference(q, CODEC.decode(k_cache), CODEC.decode(v_cache), tables, lens, bs)
    torch.testing.assert_close(got.view(len(lens), nh, d).double(), expected, atol=6e-5, rtol=1e-4)
