"""A role flip's worker half, in-process (no Ray): the engine, its weights and its cache stay,
the role's parts are made anew, and disaggregated output is unchanged. The cluster half (drain,
the pool manager, the admin API) is tested on the real cluster in tests/integration."""

from __future__ import annotations

from dataclasses import replace

import pytest

from decode_workers.colocated import ColocatedWorker
from decode_workers.worker import DecodeWorker
from engine.model import LlamaModel
from engine.role_switch import check_switch, switch_role
from prefill_workers.worker import PrefillWorker
from tests.unit.test_workers import CFG, PARAMS, disaggregated
from tests.unit.tiny import make_engine


def test_an_engine_switches_role_only_idle_and_only_where_nothing_reloads(tiny_model: LlamaModel) -> None:
    e = make_engine(tiny_model, num_blocks=64, role="prefill")
    e.add_request("a", [1, 2, 3, 4, 5], PARAMS)
    with pytest.raises(ValueError, match="drain it first"):
        check_switch(e, replace(e.config, role="decode"))
    while e.has_unfinished():
        outs = e.step()
    assert outs[0].finish_reason == "prefill_done"  # a prefill engine hands off after one token
    with pytest.raises(ValueError, match="drain it first"):  # the hand-off holds its blocks
        check_switch(e, replace(e.config, role="decode"))
    e.release("a")
    with pytest.raises(ValueError, match="num_blocks differ"):
        check_switch(e, replace(e.config, role="decode", num_blocks=32))
    switch_role(e, replace(e.config, role="decode", speculative="ngram", max_num_batched_tokens=7))
    assert e.speculator is not None and e.scheduler.max_num_batched_tokens == 7
    [done] = e.generate([[1, 2, 3, 4, 5]], PARAMS)
    assert len(done.token_ids) == PARAMS.max_tokens, "a decode engine runs requests to the end"
    switch_role(e, replace(e.config, role="prefill"))
    assert e.speculator is None
    e.check_integrity()


def test_a_flip_that_leaves_the_cache_to_memory_keeps_the_engines(tiny_model: LlamaModel) -> None:
    """The cluster's config says num_blocks None (sized from memory where each worker starts);
    the engine holds the count it came to, and a flip keeps it."""
    e = make_engine(tiny_model, num_blocks=64, role="prefill")  # as a cache sized from memory came out
    check_switch(e, replace(e.config, num_blocks=None, role="decode"))
    switch_role(e, replace(e.config, num_blocks=None, role="decode"))
    assert (e.config.role, e.config.num_blocks) == ("decode", 64)
    with pytest.raises(ValueError, match="num_blocks differ"):
        check_switch(e, replace(e.config, num_blocks=32))
    e.check_integrity()


def test_workers_flip_roles_keeping_their_engines_and_serve_the_same_tokens(model_dir: str) -> None:
    p = PrefillWorker("w1", model_dir, replace(CFG, role="prefill"))
    d = DecodeWorker("w2", model_dir, replace(CFG, role="decode"))
    c = ColocatedWorker("c", model_dir, CFG)
    prompts = [[(5 * j + i) % 128 for j in range(n)] for i, n in enumerate((9, 23))]
    live: list[PrefillWorker | DecodeWorker | ColocatedWorker] = [p, d, c]
    try:
        before = [disaggregated(p, d, f"a{i}", q)[0] for i, q in enumerate(prompts)]
        engines = (p.engine, d.engine)
        for w in (p, d):
            w.drain()
            w.close_role()
        d2 = DecodeWorker("w1", model_dir, replace(CFG, role="decode"), core=p, in_place=True)  # rehomes the cache
        p2 = PrefillWorker("w2", model_dir, replace(CFG, role="prefill"), core=d)
        live = [p2, d2, c]
        assert (d2.engine, p2.engine) == engines, "nothing reloaded"
        assert d2.receiver.shared is not None and d2.load_s < 5
        assert not d2.draining and not p2.draining
        after = [disaggregated(p2, d2, f"b{i}", q)[0] for i, q in enumerate(prompts)]
        alone = [[t for o in c.generate(f"c{i}", q, PARAMS) for t in o.token_ids] for i, q in enumerate(prompts)]
        assert before == after == alone
        _, out = disaggregated(p2, d2, "again", prompts[1])
        assert out.cached_tokens > 0, "the old decode worker's cache kept its prefixes through the flip"
        for w in (p2, d2, c):
            w.check_integrity()
        assert p2.stats()["free_blocks"] == d2.stats()["free_blocks"] == CFG.num_blocks
    finally:
        for w in live:
            w.shutdown()
