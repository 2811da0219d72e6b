"""Bad requests raise typed errors and never disturb the running batch."""

from __future__ import annotations

import pytest

from engine.errors import DuplicateRequestError, InvalidRequestError, PromptTooLongError
from engine.model import LlamaModel
from engine.sampling_params import SamplingParams
from tests.unit.tiny import make_engine


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_invalid_sampling_params(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert err.value.param == param and str(err.value)


def test_bad_requests_leave_the_batch_alone(tiny_model: LlamaModel) -> None:
    e = make_engine(tiny_model, num_blocks=64, max_model_len=64)
    good = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    e.add_request("ok", [1, 2, 3], good)
    e.step()
    cases: list[tuple[str, object, SamplingParams, type[Exception], str]] = [
        ("long", list(range(64)), good, PromptTooLongError, "prompt"),
        ("budget", list(range(60)), SamplingParams(max_tokens=10), InvalidRequestError, "max_tokens"),
        ("stop", [1, 2], SamplingParams(stop_token_ids=(999,)), InvalidRequestError, "stop_token_ids"),
        ("empty", [], good, InvalidRequestError, "prompt"),
        ("vocab", [1, 128], good, InvalidRequestError, "prompt"),
        ("text", "no tokenizer here", good, InvalidRequestError, "prompt"),
        ("ok", [4, 5], good, DuplicateRequestError, "request_id"),
    ]
    for rid, prompt, params, exc, param in cases:
        with pytest.raises(exc) as err:
            e.add_request(rid, prompt, params)  # type: ignore[arg-type]
        assert err.value.param == param, rid  # type: ignore[attr-defined]
        e.check_integrity()
    out = []
    while e.has_unfinished():
        out += e.step()
        e.check_integrity()
    assert [o.request_id for o in out] == ["ok"] * 7
    assert out[-1].finish_reason == "length"
    assert e.kv.num_free_blocks == 64


def test_prompt_that_cannot_fit_the_cache(tiny_model: LlamaModel) -> None:
    e = make_engine(tiny_model, num_blocks=4)
    with pytest.raises(PromptTooLongError):
        e.add_request("big", list(range(20)), SamplingParams(max_tokens=1))
    e.check_integrity()


def test_an_answer_that_cannot_fit_the_cache_is_refused_not_left_waiting(tiny_model: LlamaModel) -> None:
    """8 blocks of 4 hold 32 tokens: 5 + 40 was admitted, outgrew the whole cache, was preempted,
    and then waited for room that never came (the engine stepped on at nothing, for ever)."""
    e = make_engine(tiny_model, num_blocks=8)
    with pytest.raises(InvalidRequestError, match=r"max_tokens \(40\) exceeds the KV cache's 32 tokens") as err:
        e.add_request("long answer", [1, 2, 3, 4, 5], SamplingParams(max_tokens=40, ignore_eos=True))
    assert err.value.param == "max_tokens"
    e.check_integrity()
    (done,) = e.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=27, ignore_eos=True))  # all that fits
    assert len(done.token_ids) == 27 and done.finish_reason == "length"
    e.check_integrity()
