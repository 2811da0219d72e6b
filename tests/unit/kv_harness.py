"""A prefill engine streaming to a decode engine over real gRPC on loopback (tiny model)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from engine.engine import Engine
from engine.model import LlamaModel
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVTransferClient
from kv_transfer.server import SERVICE, KVTransferServer
from kv_transfer.streaming import LayerStreamer
from protos.gen import kv_transfer_pb2 as pb
from tests.unit.tiny import make_engine

SECRET = "test-cluster-secret"


@dataclass
class Pair:
    prefill: Engine
    decode: Engine
    receiver: KVReceiver
    server: KVTransferServer
    streamer: LayerStreamer
    lock: threading.RLock

    def client(self, transport: str = "grpc", timeout_s: float = 5.0, **kw: Any) -> KVTransferClient:
        """A client that holds the cluster secret (so it may Reserve over gRPC)."""
        return KVTransferClient(self.server.endpoint, transport, timeout_s, secret=SECRET, **kw)

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


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll `cond` until it holds (True) or `timeout` passes (False)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def make_pair(
    model: LlamaModel,
    lease_s: float = 5.0,
    *,
    max_chunk_bytes: int | None = None,
    min_message_bytes: int = 1,
    server_kw: Mapping[str, Any] | None = None,
    decode_kw: Mapping[str, Any] | None = None,
    in_place: bool = False,
    **prefill_kw: object,
) -> Pair:
    """Tiny prefill and decode engines (256 blocks of 4 tokens each), a KV server on loopback
    with the test cluster secret; `server_kw` go to KVTransferServer, `decode_kw` to the decode
    engine's config, `in_place` to the receiver (its cache in /dev/shm). `min_message_bytes`: the
    streamer's (default: a message a layer, as long prompts send)."""
    decode = make_engine(model, num_blocks=256, role="decode", **(decode_kw or {}))
    prefill = make_engine(model, num_blocks=256, role="prefill", **prefill_kw)
    lock = threading.RLock()
    receiver = KVReceiver(decode, lock, lease_s=lease_s, max_chunk_bytes=max_chunk_bytes, in_place=in_place)
    server = KVTransferServer(receiver, secret=SECRET, **(server_kw or {})).start()
    return Pair(prefill, decode, receiver, server, LayerStreamer(prefill, min_message_bytes), lock)


class StalledPeer:
    """A fake decode peer (the network boundary): a gRPC server of the KV service whose Push
    handler takes one message and then stops reading until `close`, as a wedged receiver
    does. `reservation` is what a Reserve would have answered, shaped like `layout_from`'s."""

    def __init__(self, layout_from: KVReceiver) -> None:
        self._resume = threading.Event()
        self.pushes = 0
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        push = grpc.stream_unary_rpc_method_handler(self._push, None, pb.PushResult.SerializeToString)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Push": push}),))
        self.endpoint = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()
        self.layout = layout_from.layout

    def reservation(self, num_blocks: int) -> pb.ReserveResponse:
        return pb.ReserveResponse(
            block_ids=list(range(num_blocks)), transfer_token="t" * 32, endpoint=self.endpoint, layout=self.layout
        )

    def _push(self, messages: Iterator[bytes], ctx: grpc.ServicerContext) -> pb.PushResult:
        self.pushes += 1
        next(messages, None)
        self._resume.wait()
        ctx.abort(grpc.StatusCode.UNAVAILABLE, "the stalled peer went away")
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._resume.set()
        self._server.stop(0)
