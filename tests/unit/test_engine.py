"""Engine paths on a tiny random model: batching, chunking, prefix cache, preemption."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.model import LlamaModel
from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk
from tests.unit.tiny import make_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(128) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def run_all(engine: Engine, new: dict[int, list[tuple[str, list[int]]]] | None = None) -> dict[str, list[int]]:
    """Step until idle, adding requests at the steps given, checking integrity every step."""
    out: dict[str, list[int]] = {}
    step = 0
    new = new or {}
    while engine.has_unfinished() or any(s >= step for s in new):
        for rid, p in new.get(step, []):
            engine.add_request(rid, p, GREEDY)
        results: list[RequestOutput] = engine.step()
        for r in results:
            out.setdefault(r.request_id, []).extend(r.new_token_ids)
        engine.check_integrity()
        step += 1
    return out


def alone(model: LlamaModel, p: list[int], params: SamplingParams = GREEDY) -> list[int]:
    e = make_engine(model, num_blocks=64)
    return e.generate([p], params)[0].token_ids


def assert_all_free(engine: Engine) -> None:
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.config.num_blocks
    assert engine.kv.num_requests == 0


def test_batched_equals_alone(tiny_model: LlamaModel) -> None:
    ps = prompts(16)
    e = make_engine(tiny_model, num_blocks=256, max_num_batched_tokens=64)
    arrivals: dict[int, list[tuple[str, list[int]]]] = {}
    for i, p in enumerate(ps):
        arrivals.setdefault(i // 2 * 3, []).append((f"r{i}", p))
    got = run_all(e, arrivals)
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == alone(tiny_model, p), f"request {i} differs in a batch"
    assert_all_free(e)


def test_chunked_prefill_equals_unchunked(tiny_model: LlamaModel) -> None:
    p = prompts(1, seed=5)[0] + prompts(1, seed=6)[0] + list(range(30))
    chunked = make_engine(tiny_model, num_blocks=64, max_num_batched_tokens=7)
    assert chunked.generate([p], GREEDY)[0].token_ids == alone(tiny_model, p)
    assert_all_free(chunked)


def test_a_short_prompt_runs_beside_a_long_ones_chunks_not_after_them(tiny_model: LlamaModel) -> None:
    """max_prefill_chunk: a long prompt takes at most that many tokens a step, so one that came
    with it gets its first token at the first step; both answers are a lone run's."""
    long, short = list(range(1, 61)), [7, 8, 9, 10, 11]
    e = make_engine(tiny_model, num_blocks=64, max_num_batched_tokens=64, max_prefill_chunk=8)
    e.add_request("long", long, GREEDY)
    e.add_request("short", short, GREEDY)
    first = e.scheduler.schedule()
    assert [(c.request.request_id, c.num_new_tokens) for c in first.prefills] == [("long", 8), ("short", 5)]
    e.scheduler.finish(e.scheduler.requests["long"], "test")  # undo the peek: start afresh
    e.scheduler.finish(e.scheduler.requests["short"], "test")
    e.check_integrity()
    assert run_all(e, {0: [("long", long), ("short", short)]}) == {"long": alone(tiny_model, long),
                                                                    "short": alone(tiny_model, short)}  # fmt: skip
    assert_all_free(e)
    uncapped = make_engine(tiny_model, num_blocks=64, max_num_batched_tokens=64, max_prefill_chunk=0)
    uncapped.add_request("long", long, GREEDY)
    uncapped.add_request("short", short, GREEDY)
    step = uncapped.scheduler.schedule()
    assert [c.num_new_tokens for c in step.prefills] == [60], "the budget cuts only, and not 4 of 5 (below)"
    uncapped.scheduler.advance(step)
    assert [c.num_new_tokens for c in uncapped.scheduler.schedule().prefills] == [5]


def test_the_prefill_chunk_resolves_per_device() -> None:
    from engine.config import CPU_PREFILL_CHUNK, EngineConfig

    assert EngineConfig().prefill_chunk == CPU_PREFILL_CHUNK
    assert EngineConfig(max_num_batched_tokens=256).prefill_chunk == 256, "never over the budget"
    assert EngineConfig(max_prefill_chunk=0).prefill_chunk == 2048, "0: the whole budget"
    assert EngineConfig(max_prefill_chunk=100).prefill_chunk == 100
    assert EngineConfig(device="meta").prefill_chunk == 2048, "off the CPU: the budget, unless set"
    with pytest.raises(ValueError, match="max_prefill_chunk"):
        EngineConfig(max_prefill_chunk=-1)


def test_prefix_cache_hit_equals_miss(tiny_model: LlamaModel) -> None:
    shared = list(range(1, 30))
    e = make_engine(tiny_model, num_blocks=64)
    first = e.generate([shared + [5, 6]], GREEDY)[0]
    second = e.generate([shared + [7, 8, 9]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 28  # 7 full blocks of 4 within the shared 29 tokens
    assert second.token_ids == alone(tiny_model, shared + [7, 8, 9])
    repeat = e.generate([shared + [5, 6]], GREEDY)[0]
    assert repeat.num_cached_tokens == 28 and repeat.token_ids == first.token_ids
    assert_all_free(e)


def test_fully_cached_prompt_recomputes_last_token(tiny_model: LlamaModel) -> None:
    p = list(range(10, 26))  # 16 tokens: exactly 4 blocks
    e = make_engine(tiny_model, num_blocks=64)
    a = e.generate([p], GREEDY)[0]
    b = e.generate([p], GREEDY)[0]
    assert b.num_cached_tokens == 12 and a.token_ids == b.token_ids
    assert_all_free(e)


def test_a_prompts_last_token_alone_is_a_prefill_chunk() -> None:
    """Prefilled as it is when the prompt runs whole, not as a decode row (another attention
    kernel), so a prefix-cache hit of all but the last token leaves the first token as it was."""
    r = Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4), arrival_seq=0)
    assert not ScheduledChunk(r, 4, 1).is_decode  # the rest of the prompt cached
    r.token_ids.append(9)
    assert ScheduledChunk(r, 5, 1).is_decode and not ScheduledChunk(r, 4, 2).is_decode
    assert ScheduledChunk(r, 5, 3, draft=(7, 8)).is_decode


def test_an_answers_tokens_recomputed_at_once_run_as_decode_rows(tiny_model: LlamaModel) -> None:
    """A replay's prompt carries the tokens already sent (`output_offset`), a preempted request
    its own outputs: those positions run as decode rows, the prompt proper as prefill chunks, so
    every position's KV comes from the kernel that first computed it (int8: engine/scheduler.py)."""
    e = make_engine(tiny_model, num_blocks=64, max_num_batched_tokens=32, enable_prefix_caching=False)
    replay = SamplingParams(max_tokens=4, temperature=0, output_offset=3)
    e.add_request("replay", list(range(10, 20)), replay)  # 7 prompt tokens + 3 sent before
    first = e.scheduler.schedule()
    assert [(c.start, c.end) for c in first.prefills] == [(0, 7)] and not first.decodes
    e.scheduler.advance(first)
    second = e.scheduler.schedule()
    assert [(c.start, c.end) for c in second.decodes] == [(7, 10)] and not second.prefills
    assert second.decodes[0].completes  # its first token comes from the last decode row
    e.scheduler.advance(second)
    e.check_integrity()
    r = Request("r", [1, 2, 3, 4, 5], GREEDY, arrival_seq=0, token_ids=[1, 2, 3, 4, 5, 6, 7, 8])
    assert r.decode_from == 5 and ScheduledChunk(r, 5, 3).is_decode and not ScheduledChunk(r, 0, 5).is_decode
    assert Request("o", [1, 2], replace(GREEDY, output_offset=5), arrival_seq=1).decode_from == 0


def test_the_budget_never_cuts_a_prompt_before_16_keys(tiny_model: LlamaModel) -> None:
    """A step's leftover budget does not start a prompt with a chunk of fewer than 16 tokens
    while more of it follows (the int8 prefill kernel rounds such a call's rows otherwise:
    Scheduler._chunk); the prompt starts next step. A prompt shorter than that runs whole or
    waits; a chunk cap below 16 still cuts, or nothing would ever run."""

    def first_step(budget: int, *lengths: int) -> list[tuple[str, int, int]]:
        e = make_engine(tiny_model, num_blocks=64, max_num_batched_tokens=budget, enable_prefix_caching=False)
        for i, n in enumerate(lengths):
            e.add_request(f"r{i}", list(range(1, n + 1)), GREEDY)
        return [(c.request.request_id, c.start, c.end) for c in e.scheduler.schedule().prefills]

    assert first_step(32, 24, 40) == [("r0", 0, 24)], "8 tokens left: r1 waits"
    assert first_step(32, 10, 40) == [("r0", 0, 10), ("r1", 0, 22)], "22 left: cut there"
    assert first_step(32, 16, 40) == [("r0", 0, 16), ("r1", 0, 16)]
    assert first_step(32, 24, 8) == [("r0", 0, 24), ("r1", 0, 8)], "a short prompt that fits runs"
    assert first_step(32, 24, 12, 4) == [("r0", 0, 24)], "one that does not waits, and so do those behind it"
    assert first_step(7, 40) == [("r0", 0, 7)], "a budget below 16 cuts"
    e = make_engine(tiny_model, num_blocks=64, max_num_batched_tokens=32, enable_prefix_caching=False)
    ps = [list(range(1, 25)), list(range(30, 70)), [5, 6, 7]]
    assert run_all(e, {0: [(f"r{i}", p) for i, p in enumerate(ps)]}) == {f"r{i}": alone(tiny_model, p)
                                                                        for i, p in enumerate(ps)}  # fmt: skip
    assert_all_free(e)


def test_an_earlier_answers_span_runs_as_decode_rows(tiny_model: LlamaModel) -> None:
    """SamplingParams.decoded: a chat's earlier answer inside the prompt runs as decode rows,
    between prefill chunks of the rest, and the answer is the one a plain run gives (fp32)."""
    e = make_engine(tiny_model, num_blocks=64, max_num_batched_tokens=32, enable_prefix_caching=False)
    prompt = list(range(10, 30))
    params = replace(GREEDY, decoded=((5, 9), (12, 15)))
    r = Request("r", prompt, params, arrival_seq=0)
    assert [r.run_from(p) for p in (0, 5, 9, 12, 15, 19)] == [
        (False, 5), (True, 9), (False, 12), (True, 15), (False, 20), (False, 20)]  # fmt: skip
    e.add_request("turn", prompt, params)
    kinds = []
    while e.has_unfinished():
        out = e.scheduler.schedule()
        kinds += [(c.is_decode, c.start, c.end) for c in out.chunks]
        e.scheduler.advance(out)
        if out.chunks[0].completes:
            break
    assert kinds == [(False, 0, 5), (True, 5, 9), (False, 9, 12), (True, 12, 15), (False, 15, 20)]
    e.abort("turn")
    e.check_integrity()
    assert alone(tiny_model, prompt, params) == alone(tiny_model, prompt)  # fp32: the rows agree
    with pytest.raises(InvalidRequestError, match="decoded"):
        SamplingParams(decoded=((5, 9), (8, 12)))
    with pytest.raises(InvalidRequestError, match="decoded"):
        SamplingParams(decoded=((9, 5),))


def test_a_prompt_cached_but_its_last_token_gives_the_tokens_of_a_cold_one(tiny_model: LlamaModel) -> None:
    p = list(range(10, 23))  # 13 tokens: 3 blocks of 4 cached, the last token alone
    e = make_engine(tiny_model, num_blocks=64)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    a, b = e.generate([p], params)[0], e.generate([p], params)[0]
    assert b.num_cached_tokens == 12 and a.token_ids == b.token_ids
    assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in b.logprobs], abs=1e-5)
    assert_all_free(e)


def test_preempted_equals_unpreempted(tiny_model: LlamaModel) -> None:
    ps = prompts(6, seed=3)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    e = make_engine(tiny_model, num_blocks=24, enable_prefix_caching=False)
    for i, p in enumerate(ps):
        e.add_request(f"r{i}", p, params)
    got: dict[str, list[int]] = {}
    preemptions = 0
    while e.has_unfinished():
        for r in e.step():
            got.setdefault(r.request_id, []).extend(r.new_token_ids)
        preemptions = max(preemptions, sum(q.num_preemptions for q in e.scheduler.requests.values()))
        e.check_integrity()
    assert preemptions > 0, "the test must force a preemption"
    assert e.scheduler.num_preemptions >= preemptions  # the running total a heartbeat reports
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == alone(tiny_model, p, params)
    assert_all_free(e)


def test_priority_runs_first(tiny_model: LlamaModel) -> None:
    e = make_engine(tiny_model, num_blocks=64, max_num_seqs=1)
    e.add_request("low", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0, priority=5))
    e.add_request("high", [4, 5, 6], SamplingParams(max_tokens=2, temperature=0, priority=0))
    first = e.step()
    assert [o.request_id for o in first] == ["high"]


def test_abort_frees_every_block(tiny_model: LlamaModel) -> None:
    e = make_engine(tiny_model, num_blocks=64, max_num_batched_tokens=8)
    for i, p in enumerate(prompts(5, seed=9)):
        e.add_request(f"r{i}", p, GREEDY)
    e.step()
    e.step()
    e.check_integrity()
    for i in range(5):
        assert e.abort(f"r{i}")
        e.check_integrity()
    assert not e.abort("r0")
    assert not e.has_unfinished()
    assert_all_free(e)


def test_seeded_sampling_is_reproducible_in_any_batch(tiny_model: LlamaModel) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    a = alone(tiny_model, [1, 2, 3], params)
    e = make_engine(tiny_model, num_blocks=64)
    e.add_request("other", [9, 9, 9, 9], SamplingParams(max_tokens=10, temperature=1.0))
    assert e.generate([[1, 2, 3]], params)[0].token_ids == a


@pytest.mark.parametrize("cut", [1, 4, 9])
def test_replayed_equals_uninterrupted(tiny_model: LlamaModel, cut: int) -> None:
    """Failover by replay: prompt + the first `cut` tokens as a new prompt, with output_offset=cut,
    continues exactly as the uninterrupted run, greedy, seeded and penalized."""
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=7, ignore_eos=True)
    # penalties count the replayed tokens as the answer's, not the prompt's
    penalized = replace(GREEDY, presence_penalty=1.0, frequency_penalty=0.5)
    assert alone(tiny_model, [5, 6, 7, 8, 9], penalized) != alone(tiny_model, [5, 6, 7, 8, 9], GREEDY)
    for params in (GREEDY, seeded, penalized):
        whole = alone(tiny_model, [5, 6, 7, 8, 9], params)
        rest = replace(params, max_tokens=params.max_tokens - cut, output_offset=cut)
        assert whole[:cut] + alone(tiny_model, [5, 6, 7, 8, 9, *whole[:cut]], rest) == whole


def test_min_tokens_holds_stop_tokens_back_and_a_replay_counts_its_earlier_outputs(tiny_model: LlamaModel) -> None:
    prompt = [5, 6, 7, 8, 9]
    free = alone(tiny_model, prompt)
    first = replace(GREEDY, ignore_eos=False, stop_token_ids=(free[1],))
    assert alone(tiny_model, prompt, first) == free[:2], "the stop token ends it at its second token"
    held = alone(tiny_model, prompt, replace(first, min_tokens=6))
    assert held[0] == free[0] and len(held) >= 6 and free[1] not in held[:6]
    # With a second stop token, one that some bound k meets right there (its answer k + 1 tokens
    # long), a replay that did not count the outputs its prompt carries would hold it back further.
    stops = (free[1], alone(tiny_model, prompt, replace(first, min_tokens=2))[2])
    answers = {k: alone(tiny_model, prompt, replace(first, stop_token_ids=stops, min_tokens=k)) for k in range(2, 9)}
    k = max(k for k, answer in answers.items() if len(answer) == k + 1 and answer[-1] in stops)
    params = replace(first, stop_token_ids=stops, min_tokens=k)
    for cut in range(1, k):
        rest = replace(params, max_tokens=params.max_tokens - cut, output_offset=cut)
        assert answers[k][:cut] + alone(tiny_model, [*prompt, *answers[k][:cut]], rest) == answers[k], cut


def test_stop_token_and_max_tokens(tiny_model: LlamaModel) -> None:
    base = alone(tiny_model, [3, 1, 4, 1, 5])
    stop_at = base[4]
    first = base.index(stop_at)
    r = make_engine(tiny_model, num_blocks=64).generate(
        [[3, 1, 4, 1, 5]], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_at,))
    )[0]
    assert r.token_ids == base[: first + 1] and r.finish_reason == "stop"
    r = make_engine(tiny_model, num_blocks=64).generate([[3, 1, 4]], SamplingParams(max_tokens=3, temperature=0))[0]
    assert len(r.token_ids) == 3 and r.finish_reason == "length"


@pytest.mark.parametrize("n_blocks", [64])
def test_prefill_then_decode_from_kv_equals_one_engine(tiny_model: LlamaModel, n_blocks: int) -> None:
    prefill = make_engine(tiny_model, num_blocks=n_blocks, role="prefill", max_num_batched_tokens=9)
    decode = make_engine(tiny_model, num_blocks=n_blocks, role="decode")
    for seed in (11, 12, 13):
        p = prompts(1, seed=seed)[0] + [7] * 10
        for params in (GREEDY, SamplingParams(max_tokens=12, temperature=0.8, seed=seed, ignore_eos=True)):
            prefill.add_request("x", p, params)
            outs: list[RequestOutput] = []
            while prefill.has_unfinished():
                outs += prefill.step()
                prefill.check_integrity()
            (handoff,) = outs
            assert handoff.finish_reason == "prefill_done" and handoff.kv is not None
            assert handoff.kv.num_tokens == len(p)
            dst = decode.reserve("x", len(p))
            decode.cache.write_blocks(dst, prefill.cache.read_blocks(handoff.kv.block_ids))
            decode.add_prefilled_request("x", p, handoff.new_token_ids[0], params)
            assert prefill.release("x")
            prefill.check_integrity()
            got: list[int] = []
            while decode.has_unfinished():
                got += [t for o in decode.step() for t in o.new_token_ids]
                decode.check_integrity()
            assert got == alone(tiny_model, p, params)
    assert_all_free(decode)
    prefill.check_integrity()
    assert prefill.kv.num_requests == 0


def test_a_prefill_engine_runs_a_whole_request_to_its_end(tiny_model: LlamaModel) -> None:
    """A request the router spilled to a prefill worker (`whole`) decodes there to its end, the
    same tokens as alone, its blocks freed; the next plain request still stops at its first."""
    prefill = make_engine(tiny_model, num_blocks=64, role="prefill", max_num_batched_tokens=9)
    p = prompts(1, seed=5)[0]
    prefill.add_request("w", p, GREEDY, whole=True)
    prefill.add_request("h", p, GREEDY)
    outs: list[RequestOutput] = []
    while prefill.has_unfinished():
        outs += prefill.step()
        prefill.check_integrity()
    whole = [o for o in outs if o.request_id == "w"]
    assert [t for o in whole for t in o.new_token_ids] == alone(tiny_model, p, GREEDY)
    assert whole[-1].finish_reason in ("stop", "length") and whole[-1].kv is None
    (handoff,) = [o for o in outs if o.request_id == "h"]
    assert handoff.finish_reason == "prefill_done" and handoff.kv is not None
    assert prefill.release("h")
    prefill.check_integrity()
    assert prefill.kv.num_requests == 0


def test_reservation_release_frees_blocks(tiny_model: LlamaModel) -> None:
    e = make_engine(tiny_model, num_blocks=16, role="decode")
    assert e.reserve("r", 10) == [0, 1, 2]
    e.check_integrity()
    assert e.release("r")
    assert_all_free(e)
