"""A prefill engine streaming to a decode engine over real gRPC on loopback (tiny model)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from engine.engine import Engine
from engine.model import LlamaModel
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVTransferClient
from kv_transfer.server import KVTransferServer
from kv_transfer.streaming import LayerStreamer
from protos.gen import kv_transfer_pb2 as pb
from tests.unit.tiny import make_engine


@dataclass
class Pair:
    prefill: Engine
    decode: Engine
    receiver: KVReceiver
    server: KVTransferServer
    streamer: LayerStreamer
    lock: threading.RLock

    def client(self, transport: str = "grpc", timeout_s: float = 5.0) -> KVTransferClient:
        return KVTransferClient(self.server.endpoint, transport, timeout_s)

    def transfer(
        self, client: KVTransferClient, rid: str, prompt: list[int], params: SamplingParams
    ) -> tuple[RequestOutput, pb.ReserveResponse, torch.Tensor]:
        """Prefill `prompt` with layer-wise streaming and commit. Returns the hand-off output,
        the reservation and a copy of the prefill side's blocks (before release)."""
        res = client.reserve(rid, len(prompt))
        push = client.push(rid, res)
        self.streamer.track(rid, push)
        self.prefill.add_request(rid, prompt, params)
        outs: list[RequestOutput] = []
        while self.prefill.has_unfinished():
            outs += [o for o in self.prefill.step() if o.request_id == rid]
        (first,) = outs
        assert first.kv is not None
        src = self.prefill.cache.read_blocks(first.kv.block_ids)
        self.streamer.untrack(rid)
        push.commit(len(prompt))
        self.prefill.release(rid)
        return first, res, src

    def close(self) -> None:
        self.server.stop(0)


def make_pair(model: LlamaModel, lease_s: float = 5.0, **prefill_kw: object) -> Pair:
    decode = make_engine(model, num_blocks=256, role="decode")
    prefill = make_engine(model, num_blocks=256, role="prefill", **prefill_kw)
    lock = threading.RLock()
    receiver = KVReceiver(decode, lock, lease_s=lease_s)
    server = KVTransferServer(receiver).start()
    return Pair(prefill, decode, receiver, server, LayerStreamer(prefill), lock)
