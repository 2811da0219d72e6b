from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, SamplerOutput, apply_min_p, apply_top_k_top_p, row_seed
from engine.sampling_params import SamplingParams

V = 50


def _logits(batch: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _draws(logits: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    """n independent draws from one row, in one batched call."""
    out = Sampler()(logits.expand(n, -1), [params] * n, [0] * n)
    return out.token_ids


def test_greedy_equals_argmax() -> None:
    logits = _logits(8)
    out = Sampler()(logits, [SamplingParams(temperature=0)] * 8, [0] * 8)
    assert out == SamplerOutput(logits.argmax(-1).tolist(), [None] * 8)


def test_top_k_one_and_tiny_top_p_equal_greedy() -> None:
    logits = _logits(6)
    expect = logits.argmax(-1).tolist()
    sampler = Sampler()
    assert sampler(logits, [SamplingParams(top_k=1)] * 6, [0] * 6).token_ids == expect
    for _ in range(5):
        assert sampler(logits, [SamplingParams(top_p=1e-6)] * 6, [0] * 6).token_ids == expect


def test_seeded_row_reproducible_and_independent_of_batch() -> None:
    logits = _logits(4, seed=1)
    seeded = SamplingParams(temperature=2.0, seed=1234)
    row = logits[2:3]
    alone = [Sampler()(row, [seeded], [k]).token_ids[0] for k in range(10)]
    assert alone == [Sampler()(row, [seeded], [k]).token_ids[0] for k in range(10)]
    others = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(seed=7)]
    for pos in range(4):
        rest = [r for r in range(4) if r != 2]
        batch = torch.cat([logits[rest[:pos]], row, logits[rest[pos:]]])
        params = [*others[:pos], seeded, *others[pos:]]
        got = [Sampler()(batch, params, [k] * 4).token_ids[pos] for k in range(10)]
        assert got == alone


def test_output_index_changes_draws() -> None:
    row = torch.zeros(1, V)
    params = SamplingParams(seed=99)
    draws = {Sampler()(row, [params], [k]).token_ids[0] for k in range(12)}
    assert len(draws) >= 6
    assert row_seed(99, 0) != row_seed(99, 1)
    assert 0 <= row_seed(2**62, 5) < 2**63 and 0 <= row_seed(-3, 1) < 2**63


def test_unseeded_rows_differ_across_calls() -> None:
    row = torch.zeros(1, V)
    assert _draws(row, SamplingParams(), 40) != _draws(row, SamplingParams(), 40)


def test_frequencies_match_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 2.0, 0.0, -1.0, 0.5]])
    n = 4000
    counts = torch.bincount(torch.tensor(_draws(logits, SamplingParams(), n)), minlength=5).float() / n
    assert torch.allclose(counts, logits.softmax(-1)[0], atol=0.03)


def test_temperature_flattens() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[3.0, 0.0, 0.0, 0.0, 0.0]])
    n = 4000
    for temp in (0.5, 1.0, 100.0):
        freq = sum(t == 0 for t in _draws(logits, SamplingParams(temperature=temp), n)) / n
        assert abs(freq - (logits / temp).softmax(-1)[0, 0].item()) < 0.03
    assert (logits / 100.0).softmax(-1)[0, 0].item() < 0.21


def test_top_k_stays_in_top_k() -> None:
    logits = torch.linspace(0, 1, V)[torch.randperm(V, generator=torch.Generator().manual_seed(3))][None]
    allowed = set(logits[0].topk(5).indices.tolist())
    draws = _draws(logits, SamplingParams(temperature=5.0, top_k=5), 2000)
    assert set(draws) == allowed


def test_top_p_stays_in_nucleus() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    probs = logits.softmax(-1)[0]  # ~[.64, .24, .09, .03, ...]
    assert probs[:2].sum() < 0.9 < probs[:3].sum()
    draws = _draws(logits, SamplingParams(top_p=0.9), 2000)
    assert set(draws) == {0, 1, 2}


def test_min_p_cuts_below_its_share_of_the_likeliest_and_comes_before_top_p() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])  # probs ~[.64, .24, .09, .03, .01, .004]
    assert set(_draws(logits, SamplingParams(min_p=0.1), 2000)) == {0, 1, 2}  # floor .064
    assert set(_draws(logits, SamplingParams(min_p=1.0), 200)) == {0}  # the likeliest alone
    assert set(_draws(logits, SamplingParams(min_p=0.1, temperature=3.0), 2000)) == {0, 1, 2, 3, 4, 5}
    inf = float("-inf")
    x = torch.tensor([[0.0, 0.0, -5.0], [1.0, 0.0, -1.0]])
    assert apply_min_p(x, torch.tensor([0.5, 0.0])).tolist() == [[0.0, 0.0, inf], [1.0, 0.0, -1.0]]
    # vLLM's order: min-p, then the nucleus of what is left. Probs [.5, .3, .1, .06, .04], min_p
    # 0.15 keeps 0-2 (.56, .33, .11 renormalized), top_p 0.85 then 0-1; the other way round, 0-2.
    logits = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]).log()
    assert set(_draws(logits, SamplingParams(min_p=0.15, top_p=0.85), 2000)) == {0, 1}
    with pytest.raises(Exception, match="min_p must be in"):
        SamplingParams(min_p=1.5)


def test_top_k_then_top_p_masks() -> None:
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    out = apply_top_k_top_p(x, torch.tensor([2, 4]), torch.tensor([1.0, 1e-3]))
    inf = float("-inf")
    assert out.tolist() == [[inf, inf, 2.0, 3.0], [3.0, inf, inf, inf]]


@pytest.mark.parametrize("n", [0, 1, 5, 20])
def test_logprobs_match_log_softmax(n: int) -> None:
    logits = _logits(3)
    params = [SamplingParams(temperature=0, logprobs=n), SamplingParams(seed=5, logprobs=n), SamplingParams()]
    out = Sampler()(logits, params, [0, 0, 0])
    logp = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    for i in range(2):
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(logp[i, lp.token_id].item(), abs=1e-5)
        assert len(lp.top) == n
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        for tok, v in lp.top:
            assert v == pytest.approx(logp[i, tok].item(), abs=1e-5)
        assert [t for t, _ in lp.top] == logp[i].topk(n).indices.tolist()


def test_mixed_batch() -> None:
    logits = _logits(5, vocab=49152, seed=4)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.95, seed=1),
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=1.2, top_k=40, logprobs=2),
        SamplingParams(),
    ]
    out = Sampler()(logits, params, [0, 3, 1, 0, 7])
    argmax = logits.argmax(-1).tolist()
    assert out.token_ids[0] == argmax[0] and out.token_ids[2] == argmax[2]
    assert out.token_ids[3] in logits[3].topk(40).indices.tolist()
    assert all(0 <= t < 49152 for t in out.token_ids)
    assert [lp is None for lp in out.logprobs] == [True, True, False, False, True]
    lp3 = out.logprobs[3]
    assert lp3 is not None and len(lp3.top) == 2 and lp3.token_id == out.token_ids[3]
    again = Sampler()(logits[1:2], params[1:2], [3])
    assert again.token_ids[0] == out.token_ids[1]


def test_bf16_logits() -> None:
    logits = _logits(4).to(torch.bfloat16)
    params = [SamplingParams(temperature=0), SamplingParams(seed=1, logprobs=2), SamplingParams(temperature=0)]
    params.append(SamplingParams(top_k=3))
    out = Sampler()(logits, params, [0] * 4)
    assert out.token_ids[0] == logits[0].float().argmax().item()
    assert out.token_ids[3] in logits[3].float().topk(3).indices.tolist()
    assert Sampler()(logits, [SamplingParams(temperature=0)] * 4, [0] * 4).token_ids == logits.argmax(-1).tolist()


def test_rejects_mismatched_batch() -> None:
    with pytest.raises(ValueError):
        Sampler()(_logits(2), [SamplingParams()], [0])
    assert Sampler()(torch.empty(0, V), [], []) == SamplerOutput([], [])
