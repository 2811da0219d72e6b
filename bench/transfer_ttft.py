"""`tandem bench transfer`'s second half: what layer-wise P/D transfer adds to the time to first
token of a 2K-token prompt, against the same prompt prefilled alone (bench/transfer_bench.py)."""

from __future__ import annotations

import time

from bench.engine_bench import make_prompts
from bench.transfer_peer import DECODE_PARAMS, DecodePeer
from engine.engine import Engine
from engine.outputs import RequestOutput
from kv_transfer.sender import KVTransferClient
from kv_transfer.streaming import LayerStreamer

TTFT_TOKENS = 2048
TTFT_KEYS = (
    *("ttft_prefill_s", "ttft_commit_s", "ttft_decode_s", "ttft_queue_s"),
    *("ttft_with_transfer_s", "ttft_prefill_only_s", "ttft_overhead_pct"),
)


def ttft_prefill_only(engine: Engine, prompt: list[int], rid: str) -> float:
    t = time.perf_counter()
    engine.add_request(rid, prompt, DECODE_PARAMS)
    outs: list[RequestOutput] = []
    while not outs:
        outs = [o for o in engine.step() if o.request_id == rid]
    dt = time.perf_counter() - t
    assert outs[0].num_cached_tokens == 0, "a prefix-cache hit: the prompts are not distinct"
    engine.release(rid)
    return dt


def ttft_with_transfer(
    engine: Engine, streamer: LayerStreamer, client: KVTransferClient, decode: DecodePeer, prompt: list[int], rid: str
) -> dict[str, float]:
    """Reserve, prefill with layer-wise streaming, commit, admit, one decode step; the phases in seconds."""
    t0 = time.perf_counter()
    res = client.reserve(rid, len(prompt))
    push = client.push(rid, res)
    streamer.track(rid, push)
    engine.add_request(rid, prompt, DECODE_PARAMS)
    outs: list[RequestOutput] = []
    while not outs:
        outs = [o for o in engine.step() if o.request_id == rid]
    t1, queue_wait = time.perf_counter(), push.queue_wait_s
    assert outs[0].num_cached_tokens == 0, "a prefix-cache hit: the prompts are not distinct"
    streamer.untrack(rid)
    push.commit(len(prompt))
    t2 = time.perf_counter()
    decode.first_token(rid, prompt, outs[0].new_token_ids[0])
    t3 = time.perf_counter()
    engine.release(rid)
    return {"total": t3 - t0, "prefill": t1 - t0, "commit": t2 - t1, "decode": t3 - t2, "queue": queue_wait}


def measure_ttft(source: Engine, decode: DecodePeer, transport: str) -> dict[str, float | None]:
    """TTFT of 2K-token prompts, prefilled alone on `source` and streamed to `decode` from a second
    prefill engine. Each run gives both engines the same prompt, a new one each run: their prefix
    caches are separate, so nothing hits."""
    streaming = Engine(source.model, source.tokenizer, source.config)
    streamer = LayerStreamer(streaming)
    client = KVTransferClient(decode.endpoint, transport, timeout_s=30, secret=decode.secret)
    with_t: list[dict[str, float]] = []
    alone: list[float] = []
    try:
        # the first prompt warms up; interleaved, so drift from other load on the machine hits both alike
        for i, prompt in enumerate(make_prompts(source, 4, TTFT_TOKENS)):
            with_t.append(ttft_with_transfer(streaming, streamer, client, decode, prompt, f"ttft-{i}"))
            alone.append(ttft_prefill_only(source, prompt, f"ttft-{i}"))
    finally:
        client.close()
    best = min(with_t[1:], key=lambda r: r["total"])  # its phases are reported with it
    res: dict[str, float | None] = {f"ttft_{k}_s": v for k, v in best.items() if k != "total"}
    res["ttft_with_transfer_s"], res["ttft_prefill_only_s"] = best["total"], min(alone[1:])
    res["ttft_overhead_pct"] = 100 * (best["total"] / min(alone[1:]) - 1)
    return res
