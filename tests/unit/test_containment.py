"""A step that raises fails the request that set it off, and no other (engine/containment.py).

The faults come in at the engine's declared boundaries: its per-step layer hook (`Engine.layer_hook`,
whose callback runs inside the forward pass, after a layer's KV is written) and its tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers.models import WordLevel

from engine.config import EngineConfig
from engine.containment import MAX_STRIKES
from engine.drafters import Draft, PromptLookup
from engine.engine import Engine
from engine.errors import StreamError
from engine.loop import EngineLoop
from engine.model import LayerCallback, LlamaModel
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.speculation import Speculator
from engine.tokenizer import Tokenizer
from tests.unit.tiny import make_engine

PROMPTS = {"a": [1, 2, 3, 4, 5], "b": [6, 7, 8, 9, 99], "c": [10, 11, 12, 13, 14, 15, 16], "d": [17, 18, 19]}
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

Ended = tuple[list[int], str | None, str | None]  # tokens, finish reason, error


def poisoned(when: Callable[[SchedulerOutput], bool]) -> Callable[[SchedulerOutput], LayerCallback | None]:
    """A layer hook whose callback raises after the first layer's KV is written, in a step `when`
    picks: a fault in the forward pass that some request sets off."""

    def hook(out: SchedulerOutput) -> LayerCallback | None:
        if not when(out):
            return None

        def on_layer(i: int) -> None:
            raise RuntimeError("poisoned step")

        return on_layer

    return hook


def runs(rid: str, from_output: int = 0) -> Callable[[SchedulerOutput], bool]:
    """A step that runs `rid` once it has `from_output` output tokens."""
    return lambda out: any(c.request.request_id == rid and c.request.num_output_tokens >= from_output
                           for c in out.chunks)  # fmt: skip


def run(
    engine: Engine, prompts: dict[str, list[int]] = PROMPTS, release: bool = False, **whole: bool
) -> dict[str, Ended]:
    """Every prompt to its end, the engine's integrity checked after each step; `release`: a
    prefill hand-off's blocks freed at its first token, as its worker does after the transfer."""
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, PARAMS, whole=whole.get(rid, False))
    ended: dict[str, Ended] = {rid: ([], None, None) for rid in prompts}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        assert steps < 200, "the engine did not get through its requests"
        for o in engine.step():
            tokens, _, _ = ended[o.request_id]
            ended[o.request_id] = (tokens + o.new_token_ids, o.finish_reason, o.error)
            if release and o.kv is not None:
                engine.release(o.request_id)
        engine.check_integrity()
    assert engine.kv.num_requests == 0, "blocks left held"
    return ended


@pytest.fixture
def clean(tiny_model: LlamaModel) -> dict[str, Ended]:
    return run(make_engine(tiny_model, num_blocks=64))


@pytest.mark.parametrize("from_output", [0, 3], ids=["from-its-first-step", "mid-answer"])
def test_a_failing_step_fails_the_request_that_set_it_off_and_no_other(
    tiny_model: LlamaModel, clean: dict[str, Ended], from_output: int
) -> None:
    engine = make_engine(tiny_model, num_blocks=64)
    engine.layer_hook = poisoned(runs("b", from_output))
    ended = run(engine)
    tokens, reason, error = ended.pop("b")
    assert reason == "error" and error is not None and "RuntimeError: poisoned step" in error
    assert tokens == clean["b"][0][: len(tokens)] and len(tokens) == from_output, "what it had sent stands"
    assert ended == {rid: clean[rid] for rid in ended}, "the others' answers, token for token"
    assert engine.quarantine.suspects == set()


def test_a_fault_only_a_mix_sets_off_ends_after_max_strikes_and_hangs_nothing(tiny_model: LlamaModel) -> None:
    """Each passes alone, the batch fails: after MAX_STRIKES failed steps the batch's requests fail."""
    engine = make_engine(tiny_model, num_blocks=64)
    engine.layer_hook = poisoned(lambda out: {"a", "c"} <= {c.request.request_id for c in out.chunks})
    ended = run(engine, {rid: PROMPTS[rid] for rid in "ac"})
    assert {rid: (len(t), r) for rid, (t, r, _) in ended.items()} == {"a": (MAX_STRIKES - 1, "error"),
                                                                       "c": (MAX_STRIKES - 1, "error")}  # fmt: skip


def test_on_a_prefill_engine_hand_offs_and_whole_requests_are_isolated_alike(
    tiny_model: LlamaModel, clean: dict[str, Ended]
) -> None:
    """The poisoned hand-off fails (no token out yet: the router retries it elsewhere); the other
    hand-off reaches its first token and hands its blocks off (its chunk's KV streamed again whole,
    tests/unit/test_kv_transfer.py); a request run whole on the prefill worker goes on."""
    engine = Engine(tiny_model, None, EngineConfig(dtype="fp32", block_size=4, num_blocks=64, role="prefill"))
    engine.layer_hook = poisoned(runs("a"))
    ended = run(engine, {"a": PROMPTS["a"], "b": PROMPTS["b"], "d": PROMPTS["d"]}, d=True, release=True)
    assert ended["a"][1] == "error" and ended["a"][0] == []
    assert ended["b"][:2] == (clean["b"][0][:1], "prefill_done")
    assert ended["d"] == clean["d"]


class _PoisonTokenizer(Tokenizer):
    """Decoding token 99 raises: a fault in one request's post-processing (its detokenizer)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if 99 in ids:
            raise ValueError("token 99 does not decode")
        return super().decode(ids, skip_special_tokens)


def test_a_request_whose_post_processing_fails_fails_alone(tiny_model: LlamaModel, clean: dict[str, Ended]) -> None:
    vocab = {f"t{i}": i for i in range(tiny_model.config.vocab_size)}
    backend = Backend(WordLevel(vocab, unk_token="t0"))
    tok = _PoisonTokenizer(backend, eos_token_id=0, bos_token_id=None, stop_token_ids=frozenset(),
                           special_token_ids=frozenset(), chat_template=None)  # fmt: skip
    engine = Engine(tiny_model, tok, EngineConfig(dtype="fp32", block_size=4, num_blocks=64))
    ended = run(engine)  # b's prompt ends in 99: its detokenizer fails on its first token
    tokens, reason, error = ended.pop("b")
    assert (tokens, reason) == ([], "error") and error is not None and "token 99 does not decode" in error
    assert {rid: e[:2] for rid, e in ended.items()} == {rid: clean[rid][:2] for rid in ended}


def test_the_loop_ends_only_the_failed_requests_stream_with_the_error(tiny_model: LlamaModel) -> None:
    engine = make_engine(tiny_model, num_blocks=64)
    engine.layer_hook = poisoned(runs("b"))
    loop = EngineLoop(engine)
    with loop.lock:  # all three in the first step
        streams = {rid: loop.open(rid, lambda r=rid: engine.add_request(r, PROMPTS[r], PARAMS)) for rid in "abc"}
    loop.start()
    try:
        with pytest.raises(StreamError, match="the engine failed on this request: RuntimeError: poisoned step"):
            list(streams["b"].iterate(timeout=30))
        for rid in "ac":
            outs = list(streams[rid].iterate(timeout=30))
            assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 8
        loop.check_integrity()
        assert loop.num_streams == 0
    finally:
        loop.stop()


class _PoisonDrafter(PromptLookup):
    """Proposing for a text that holds token 99 raises: a fault in one request's drafter."""

    def propose(self) -> Draft:
        if 99 in self.tokens:
            raise IndexError("no draft for 99")
        return super().propose()


def test_a_request_whose_drafter_fails_runs_on_without_speculation(
    tiny_model: LlamaModel, clean: dict[str, Ended], caplog: pytest.LogCaptureFixture
) -> None:
    """Speculation only saves time: its drafter failing is no reason to fail the request, or the step."""
    engine = make_engine(tiny_model, num_blocks=64, speculative="ngram")
    engine.speculator = Speculator(engine.kv, 4, engine.max_model_len, new_drafter=_PoisonDrafter)
    with caplog.at_level("ERROR", logger="engine.speculation"):
        assert run(engine) == clean
    assert "drafting for request b failed; it runs on without speculation" in caplog.text
    assert caplog.text.count("drafting for request") == 1, "once: it drafts no more"
