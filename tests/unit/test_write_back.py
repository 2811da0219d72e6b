"""Write-back (kv_transfer/write_back.py) between in-process workers over real gRPC on loopback:
a finished P/D turn's answer KV lands in the prefill worker's prefix cache, the next turn's
prefill hits it, and its tokens equal a cold run. Failures free both sides."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from decode_workers.colocated import ColocatedWorker
from decode_workers.worker import DecodeWorker
from engine.cache_keys import cache_keys
from engine.config import EngineConfig
from engine.errors import NoFreeBlocksError
from engine.kv_cache import KVCacheManager, prefix_hashes
from engine.sampling_params import SamplingParams
from kv_transfer.errors import KVTransferError
from kv_transfer.sender import KVTransferClient
from kv_transfer.write_back import WriteBackResult, WriteBackTicket
from prefill_workers.worker import PrefillWorker
from protos.gen import kv_transfer_pb2 as pb
from tests.unit.tiny import TINY, tiny_weights

BS, BLOCKS = 4, 128
CFG = EngineConfig(dtype="fp32", block_size=BS, num_blocks=BLOCKS, max_num_batched_tokens=16)
GREEDY = SamplingParams(max_tokens=11, temperature=0, ignore_eos=True)

Workers = tuple[PrefillWorker, DecodeWorker, ColocatedWorker]


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    from engine.weights import save_hf_dir

    d = tmp_path_factory.mktemp("tiny")
    save_hf_dir(d, TINY, tiny_weights())
    p = PrefillWorker("p0", str(d), replace(CFG, role="prefill"))
    dw = DecodeWorker("d0", str(d), replace(CFG, role="decode"))
    c = ColocatedWorker("c0", str(d), CFG)
    yield p, dw, c
    for w in (p, dw, c):
        w.shutdown()


def turn(
    p: PrefillWorker, d: DecodeWorker, rid: str, prompt: list[int], params: SamplingParams = GREEDY
) -> tuple[list[int], int]:
    """One P/D turn: its answer and the tokens the prefill worker found cached."""
    out = p.prefill(rid, prompt, params, d.reserve(rid, len(prompt)))
    answer = [t for o in d.generate(rid, prompt, out.first.token_ids[0], params) for t in o.token_ids]
    return answer, out.cached_tokens


def write_back(
    p: PrefillWorker, d: DecodeWorker, rid: str, prompt: list[int], answer: list[int]
) -> WriteBackResult | None:
    """The turn's KV copied back, named by its cache keys as cluster.handoff sends them."""

    def reserve(ts: list[int]) -> WriteBackTicket | None:
        return p.reserve_write_back(rid, ts)

    keys = cache_keys(prompt + answer, len(prompt), GREEDY)
    return d.send_write_back(rid, keys, reserve, lambda ts: p.adopt_write_back(rid, ts))


def check(*workers: PrefillWorker | DecodeWorker | ColocatedWorker) -> None:
    for w in workers:
        w.check_integrity()
        assert w.stats()["free_blocks"] == BLOCKS, f"{w.worker_id} holds blocks after the turn"


def test_the_next_turn_prefills_only_its_new_message(workers: Workers) -> None:
    p, d, c = workers
    prompt = [(13 * i + 5) % 128 for i in range(18)]
    answer, _ = turn(p, d, "t1", prompt)
    p.pop_block_events()
    res = write_back(p, d, "t1.wb", prompt, answer)
    check(p, d)
    # the decode engine ran prompt + answer[:-1]; the prefill side had the prompt's 4 full blocks
    written = (len(prompt) + len(answer) - 1) // BS
    assert res is not None and res.blocks == written - len(prompt) // BS and res.bytes > 0
    stored, _ = p.pop_block_events()
    keys = cache_keys(prompt + answer, len(prompt), GREEDY)
    assert stored == prefix_hashes(keys, BS)[len(prompt) // BS : written], "adopted blocks are indexed"

    nxt = prompt + answer + [9, 8, 7, 6, 5]
    marked = replace(GREEDY, decoded=((len(prompt), len(prompt) + len(answer)),))  # as the router marks a chat's
    again, cached = turn(p, d, "t2", nxt, marked)
    assert cached == written * BS
    assert again == [t for o in c.generate("cold", nxt, marked) for t in o.token_ids], "equal to a cold run"
    check(p, d, c)
    assert write_back(p, d, "t1.wb2", prompt, answer) is None, "nothing left to send"
    check(p, d)


def test_a_failed_write_back_frees_both_sides(workers: Workers) -> None:
    p, d, _ = workers
    prompt = [(7 * i + 1) % 128 for i in range(10)]
    answer, _ = turn(p, d, "f1", prompt)

    def refused(_: list[int]) -> WriteBackTicket | None:
        raise RuntimeError("target gone")

    with pytest.raises(RuntimeError):
        d.send_write_back("f1.a", cache_keys(prompt + answer, len(prompt), GREEDY), refused, lambda _: None)
    check(p, d)

    def dropped(ts: list[int]) -> WriteBackTicket | None:  # the target lets go before the push
        ticket = p.reserve_write_back("f1.b", ts)
        assert ticket is not None
        res = pb.ReserveResponse.FromString(ticket.reservation)
        client = KVTransferClient(res.endpoint)
        assert client.release("f1.b", res.transfer_token, "test")
        client.close()
        return ticket

    with pytest.raises(KVTransferError):
        d.send_write_back(
            "f1.b", cache_keys(prompt + answer, len(prompt), GREEDY), dropped, lambda ts: p.adopt_write_back("f1.b", ts)
        )
    check(p, d)
    with pytest.raises(KVTransferError):  # no committed transfer to adopt
        p.adopt_write_back("f1.c", prompt)
    check(p, d)


def test_a_decode_workers_abort_releases_a_reservation_through_its_receiver(workers: Workers) -> None:
    """What the router's abort of a request still in transfer does on the decode worker: its
    lease and its blocks go together."""
    _, dw, _ = workers
    free = dw.engine.kv.num_free_blocks
    dw.reserve("in-transfer", 20)
    assert dw.engine.kv.num_free_blocks < free
    assert dw.abort("in-transfer") and "in-transfer" not in dw.receiver.table
    assert dw.engine.kv.num_free_blocks == free and not dw.abort("in-transfer")
    dw.check_integrity()


def test_reserve_uncached_holds_nothing_when_blocks_run_out() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.reserve_uncached("a", [1, 2, 3, 4])
    kv.cache_full_blocks("a", [1, 2, 3, 4], 4)
    kv.free("a")
    assert kv.reserve_uncached("b", [1, 2, 3, 4, 5, 6]) == (4, kv.block_table("b")[2:])
    with pytest.raises(NoFreeBlocksError):
        kv.reserve_uncached("c", [1, 2, 3, 4, 9, 9, 8, 8, 7, 7])
    kv.check_integrity()
    assert not kv.has_request("c")
    kv.free("b")
    kv.check_integrity()
    assert kv.num_free_blocks == 4
