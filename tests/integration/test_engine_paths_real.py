"""Cache, chunking, preemption and the P/D seam on the real model: all give the tokens one plain run gives."""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_budget import KV_CAP_BYTES, auto_blocks, available_bytes, cpu_share
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
QUESTIONS = [
    "Why is the sky blue?",
    "Name a famous painting by Leonardo da Vinci.",
    "What does a compiler do?",
    "Give me a synonym for 'happy'.",
]


def sibling(base: Engine, **kw: object) -> Engine:
    """Another engine over the same loaded weights."""
    return Engine(base.model, base.tokenizer, EngineConfig(dtype="fp32", **kw))  # type: ignore[arg-type]


def chats(engine: Engine) -> list[str]:
    assert engine.tokenizer is not None
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


def run_short_of_blocks(
    engine: Engine, prompts: Sequence[str | list[int]], params: SamplingParams
) -> tuple[list[list[int]], int]:
    """All prompts at once on an engine too small for them: each one's tokens, and the most
    preemptions seen at once; check_integrity() after every step."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    preempted = 0
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
        preempted = max(preempted, sum(r.num_preemptions for r in engine.scheduler.requests.values()))
        engine.check_integrity()
    return [got[f"r{i}"] for i in range(len(prompts))], preempted


def test_chunked_prefill_prefix_cache_and_preemption(engine_fp32: Engine) -> None:
    prompts = chats(engine_fp32)
    plain = [r.token_ids for r in engine_fp32.generate(prompts, GREEDY)]
    chunked = sibling(engine_fp32, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert [r.token_ids for r in chunked.generate(prompts, GREEDY)] == plain
    cached = sibling(engine_fp32, num_blocks=256)
    cached.generate(prompts[:1], GREEDY)
    hits = cached.generate(prompts, GREEDY)
    assert all(r.num_cached_tokens > 0 for r in hits)  # the system prompt is shared
    assert [r.token_ids for r in hits] == plain
    tight = sibling(engine_fp32, num_blocks=12, block_size=16, enable_prefix_caching=False)
    got, preempted = run_short_of_blocks(tight, prompts, GREEDY)
    assert preempted > 0
    assert got == plain
    for e in (chunked, cached, tight):
        e.check_integrity()
        assert e.kv.num_free_blocks == e.config.num_blocks


def test_a_cache_sized_from_memory_holds_its_share_and_runs_alike(engine_fp32: Engine) -> None:
    """num_blocks None (`tandem serve`'s default): the blocks a quarter of this host's available
    memory holds for a worker of 1 of its cores, at most 2 GiB, and the tokens of any other size."""
    threads = torch.get_num_threads()
    auto = sibling(engine_fp32, num_blocks=None, num_threads=1)  # (sets torch's threads)
    try:
        n = auto.config.num_blocks
        assert n is not None and n == auto.kv.num_blocks == auto.cache.num_blocks
        block = auto.cache.bytes_per_block
        expect = auto_blocks(
            block, 16, auto.max_model_len, available_bytes(), cpu_share(1, os.cpu_count()), KV_CAP_BYTES
        )
        assert abs(n - expect.num_blocks) <= max(expect.num_blocks // 100, 1)  # the memory moved a little in between
        assert n * block <= KV_CAP_BYTES or n == -(-auto.max_model_len // 16)
        prompts = chats(engine_fp32)
        assert [r.token_ids for r in auto.generate(prompts, GREEDY)] == [
            r.token_ids for r in engine_fp32.generate(prompts, GREEDY)
        ]
        auto.check_integrity()
    finally:
        torch.set_num_threads(threads)


def test_prefill_engine_then_decode_engine(engine_fp32: Engine) -> None:
    prefill = sibling(engine_fp32, role="prefill", num_blocks=128)
    decode = sibling(engine_fp32, role="decode", num_blocks=128)
    for prompt in chats(engine_fp32):
        for params in (GREEDY, SamplingParams(max_tokens=24, temperature=0.7, seed=7)):
            expected = engine_fp32.generate([prompt], params)[0]
            prefill.add_request("x", prompt, params)
            outs: list[RequestOutput] = []
            while prefill.has_unfinished():
                outs += prefill.step()
            (first,) = outs
            assert first.kv is not None
            ids = prefill.kv.block_table("x")
            dst = decode.reserve("x", first.kv.num_tokens)
            decode.cache.write_blocks(dst, prefill.cache.read_blocks(ids))
            assert decode.tokenizer is not None
            decode.add_prefilled_request("x", decode.tokenizer.encode(prompt), first.new_token_ids[0], params)
            prefill.release("x")
            tokens, text = [], ""
            while decode.has_unfinished():
                for o in decode.step():
                    tokens += o.new_token_ids
                    text += o.new_text
            assert tokens == expected.token_ids and text == expected.text
            prefill.check_integrity()
            decode.check_integrity()
    assert prefill.kv.num_free_blocks == decode.kv.num_free_blocks == 128


def test_speculation_gives_the_tokens_of_no_speculation(engine_fp32: Engine) -> None:
    """Prompt-lookup speculation (engine/speculation.py), fp32: greedy, seeded sampling with
    logprobs, and a stop string crossed inside an accepted run, token for token as without it."""
    assert engine_fp32.tokenizer is not None
    text = "The lighthouse keeper climbed the stairs at dusk, lit the lamp, and watched the ships pass."
    copy = engine_fp32.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this sentence twice, word for word: {text}"}]
    )
    prompts = [copy, *chats(engine_fp32)]
    spec = sibling(engine_fp32, num_blocks=512, speculative="ngram")
    settings = [
        SamplingParams(max_tokens=48, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=48, temperature=0.7, top_p=0.9, seed=3, logprobs=2),
        SamplingParams(max_tokens=48, temperature=0, stop=["ships"]),
    ]
    for params in settings:
        off = engine_fp32.generate(prompts, params)
        on = spec.generate(prompts, params)
        for a, b in zip(on, off, strict=True):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            assert [x.token_id for x in a.logprobs] == [x.token_id for x in b.logprobs]
            assert all(abs(x.logprob - y.logprob) < 1e-3 for x, y in zip(a.logprobs, b.logprobs, strict=True))
        spec.check_integrity()
    assert off[0].finish_reason == "stop" and off[0].text.endswith("and watched the ")
    assert spec.speculator is not None and spec.speculator.accepted > 20


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_speculation_with_arrivals_gives_the_tokens_of_none(model_path: str, dtype: str) -> None:
    """int8 or int4 (what `auto` is, by CPU) and suffix speculation, as `tandem serve` runs by
    default, with prompts arriving while others decode, so steps mix prefill chunks, decode rows
    and drafts: every request's greedy tokens are those of speculation off (a row's bits do not
    depend on its step where the per-row kernels run; without AVX512-VNNI or AVX2 int8 prefills
    go through fbgemm)."""
    from engine.native import ops

    native = ops()
    if native is None or not native.linear_i8_fast:
        pytest.skip("no per-row int8 kernel (AVX512-VNNI or AVX2): steps with prefills quantize per tensor")
    off = Engine.from_path(model_path, EngineConfig(dtype=dtype, num_blocks=512, max_prefill_chunk=32))
    on = Engine(off.model, off.tokenizer, EngineConfig(dtype=dtype, num_blocks=512, max_prefill_chunk=32,
                                                       speculative="suffix"))  # fmt: skip
    prompts = chats(off) * 2
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    results = {}
    for name, engine in (("off", off), ("on", on)):
        tokens: dict[str, list[int]] = {}
        pending, step = list(enumerate(prompts)), 0
        while pending or engine.has_unfinished():
            if pending and step % 4 == 0:  # a new prompt every 4 steps
                i, p = pending.pop(0)
                tokens[f"r{i}"] = []
                engine.add_request(f"r{i}", p, params)
            for o in engine.step():
                tokens[o.request_id] += o.new_token_ids
            step += 1
        engine.check_integrity()
        results[name] = tokens
    assert results["on"] == results["off"]
    assert on.speculator is not None and on.speculator.accepted > 0


@pytest.mark.parametrize("length", [97, 113])
def test_int8_prompt_cached_but_its_last_token_gives_the_cold_tokens_and_logprobs(model_path: str, length: int) -> None:
    """int8 (`auto` on VNNI CPUs) with its int8 prefill attention: a prompt whose prefix cache
    holds every token but the last gives, bit for bit, what it gave cold. Its last token is then
    prefilled alone, and ran as a decode row (another attention kernel) until a later session:
    greedy answers of `tandem bench spec`'s agentic prompts changed from their first token."""
    from engine.native import ops

    native = ops()
    if native is None or not native.linear_i8_fast or not native.prefill_attention_i8_fast:
        pytest.skip("no per-row int8 kernels (AVX512-VNNI): rows of a prefill depend on their chunk")
    e = Engine.from_path(model_path, EngineConfig(dtype="int8", num_blocks=256, block_size=16))
    assert e.tokenizer is not None
    text = e.tokenizer.apply_chat_template([{"role": "user", "content": " ".join(QUESTIONS * 4)}])
    prompt = e.tokenizer.encode(text)[:length]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    cold, warm = e.generate([prompt], params)[0], e.generate([prompt], params)[0]
    assert warm.num_cached_tokens == length - 1
    assert warm.token_ids == cold.token_ids
    assert [x.logprob for x in warm.logprobs] == [x.logprob for x in cold.logprobs]
    e.check_integrity()


@pytest.fixture(scope="module")
def engine_int8(model_path: str) -> Engine:
    """int8 where its rows do not depend on their step (the per-row kernel); skips elsewhere."""
    from engine.native import ops

    native = ops()
    if native is None or not native.linear_i8_fast:
        pytest.skip("no per-row int8 kernels (AVX512-VNNI): a row's result depends on its step")
    return Engine.from_path(model_path, EngineConfig(dtype="int8", num_blocks=256, block_size=16))


def test_int8_replays_and_preemption_give_the_uninterrupted_tokens_and_logprobs(engine_int8: Engine) -> None:
    """int8: an answer's tokens recomputed at once, as a failover replays them (prompt + the
    tokens sent, `output_offset`) or a preempted request recomputes them, run as the decode rows
    that first computed them, so the rest of the answer is the uninterrupted one, bit for bit.
    Prefilled as prompt tokens (another attention kernel), 0 of 16 greedy replays had kept it."""
    from dataclasses import replace

    e = engine_int8
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=1)
    seeded = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
    assert e.tokenizer is not None
    prompts = [e.tokenizer.encode(p) for p in chats(e)[:2]]
    for prompt in prompts:
        for params in (greedy, seeded):
            whole = e.generate([prompt], params)[0]
            for cut in (1, 7, 20):
                rest = replace(params, max_tokens=params.max_tokens - cut, output_offset=cut)
                replay = e.generate([prompt + whole.token_ids[:cut]], rest)[0]
                assert whole.token_ids[:cut] + replay.token_ids == whole.token_ids, (cut, params)
                if params.logprobs:
                    assert [x.logprob for x in replay.logprobs] == [x.logprob for x in whole.logprobs[cut:]]
                e.check_integrity()
    plain = [r.token_ids for r in e.generate(prompts * 2, greedy)]
    tight = Engine(e.model, e.tokenizer, EngineConfig(dtype="int8", num_blocks=14, block_size=16))
    got, preempted = run_short_of_blocks(tight, prompts * 2, greedy)
    assert preempted > 0
    assert got == plain
    assert tight.kv.num_free_blocks == tight.config.num_blocks


def test_int8_a_second_turn_answers_alike_with_the_first_cached_or_not(engine_int8: Engine) -> None:
    """int8: a second turn whose prompt holds the first answer, marked as the router marks it
    (`Tokenizer.encode_marking`, SamplingParams.decoded), gives the same tokens and logprobs
    whether the cache still holds the first turn's KV (as decode rows wrote it) or not. Unmarked
    (a completions prompt), the answer is prefilled warm as cold: the cache's blocks say how their
    KV was computed (engine/cache_keys.py), and the answer's are not this prompt's. Before they
    did, an unmarked second turn hit the decode rows' KV: 2 of 6 such chats answered as cold."""
    from dataclasses import replace

    warm = engine_int8
    cold = Engine(warm.model, warm.tokenizer, EngineConfig(dtype="int8", num_blocks=256, enable_prefix_caching=False))
    tok = warm.tokenizer
    assert tok is not None
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=1)
    for question in QUESTIONS[:3]:
        first = [{"role": "user", "content": question}]
        answer = warm.generate([tok.apply_chat_template(first)], params)[0].text
        chat = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Say it shorter."}]
        text = tok.apply_chat_template(chat)
        ids, spans = tok.encode_marking(text, [(text.index(answer), text.index(answer) + len(answer))])
        assert len(spans) == 1 and tok.decode(ids[spans[0][0] : spans[0][1]]) == answer
        second = replace(params, decoded=spans)
        hit, miss = warm.generate([ids], second)[0], cold.generate([ids], second)[0]
        assert hit.num_cached_tokens > spans[0][0] and miss.num_cached_tokens == 0
        assert hit.token_ids == miss.token_ids
        assert [x.logprob for x in hit.logprobs] == [x.logprob for x in miss.logprobs]
        plain, plain_cold = warm.generate([ids], params)[0], cold.generate([ids], params)[0]
        assert 0 < plain.num_cached_tokens <= spans[0][0], "the first prompt's blocks hit, the answer's not"
        assert plain.token_ids == plain_cold.token_ids
        assert [x.logprob for x in plain.logprobs] == [x.logprob for x in plain_cold.logprobs]
        warm.check_integrity()
        cold.check_integrity()


@pytest.mark.parametrize("first_chunk", [5, 14])
def test_int8_a_prompt_sharing_a_step_gives_its_lone_bits_and_caches_it(engine_int8: Engine, first_chunk: int) -> None:
    """int8: a prompt whose step has only `first_chunk` tokens of budget left for it gives the
    tokens and logprobs it gives alone, and so does another chat that then reuses its cached
    prefix (the system prompt's blocks). The budget once cut it there; the int8 prefill kernel
    centres keys on the mean of a call's first 16 (of fewer in a shorter call), so its first
    token's logprob changed, and decode workers' prefix caches carried that KV to other chats:
    1 stream in 32 of the fault tests' decode kill answered otherwise in 2 of ~10 clusters."""
    tok = engine_int8.tokenizer
    assert tok is not None
    cold = Engine(engine_int8.model, tok, EngineConfig(dtype="int8", num_blocks=256, enable_prefix_caching=False))
    shared = Engine(engine_int8.model, tok, EngineConfig(dtype="int8", num_blocks=256, max_num_batched_tokens=256))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    first, second = (tok.encode(c) for c in chats(engine_int8)[:2])
    filler = tok.encode(" ".join(QUESTIONS * 20))[: 256 - first_chunk]
    got = shared.generate([filler, first], params)[1]
    reused = shared.generate([second], params)[0]
    assert reused.num_cached_tokens >= 16, "the second chat reuses the first's cached blocks"
    for result, prompt in ((got, first), (reused, second)):
        alone = cold.generate([prompt], params)[0]
        assert result.token_ids == alone.token_ids
        assert [x.logprob for x in result.logprobs] == [x.logprob for x in alone.logprobs]
    shared.check_integrity()
    cold.check_integrity()
