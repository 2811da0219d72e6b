"""The real model, prefilled on one engine and decoded on another through gRPC and shm (through
segments, and in place into a decode cache in /dev/shm)."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from kv_transfer.receiver import KVReceiver
from kv_transfer.server import KVTransferServer
from kv_transfer.streaming import LayerStreamer
from tests.unit.kv_harness import SECRET, Pair


@pytest.mark.parametrize("transport,in_place", [("grpc", False), ("shm", False), ("shm", True)])
def test_disaggregated_equals_one_engine(engine_fp32: Engine, transport: str, in_place: bool) -> None:
    def sibling(**kw: object) -> Engine:
        return Engine(engine_fp32.model, engine_fp32.tokenizer, EngineConfig(dtype="fp32", num_blocks=128, **kw))  # type: ignore[arg-type]

    decode, prefill = sibling(role="decode"), sibling(role="prefill", max_num_batched_tokens=32)
    lock = threading.RLock()
    receiver = KVReceiver(decode, lock, in_place=in_place)
    assert (receiver.shared is not None) == in_place
    server = KVTransferServer(receiver, secret=SECRET).start()
    pair = Pair(prefill, decode, receiver, server, LayerStreamer(prefill), lock)
    client = pair.client(transport)
    tok = engine_fp32.tokenizer
    assert tok is not None
    try:
        for i, q in enumerate(["Tell me about the moon.", "What is 17 times 3?"]):
            prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
            params = SamplingParams(max_tokens=20, temperature=0)
            first, res, src = pair.transfer(client, f"q{i}", prompt, params)
            stats = receiver.wait(f"q{i}", 5)
            assert stats.bytes == src.numel() * src.element_size()
            assert torch.equal(decode.cache.read_blocks(list(res.block_ids)), src)
            receiver.admit(f"q{i}", prompt, first.new_token_ids[0], params)
            tokens: list[int] = []
            while decode.has_unfinished():
                with lock:
                    tokens += [t for o in decode.step() for t in o.new_token_ids]
            assert tokens == engine_fp32.generate([prompt], params)[0].token_ids
            receiver.check_integrity()
        assert decode.kv.num_free_blocks == prefill.kv.num_free_blocks == 128
    finally:
        client.close()
        pair.close()
