"""A KV transfer peer in its own process, for failure tests: `python -m tests.integration.kv_peer MODE ...`.

receiver            serve a tiny decode engine; print the endpoint; run until killed (or stopped)
sender ENDPOINT     reserve, push a few chunks, print "sent", then hang until killed

Both sides hold SECRET, the cluster secret a Reserve over gRPC needs.
"""

from __future__ import annotations

import sys
import threading
import time

import torch

from engine.model import LlamaModel
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVTransferClient
from kv_transfer.server import KVTransferServer
from kv_transfer.wire import DTYPES
from tests.unit.tiny import TINY, make_engine, tiny_weights

SECRET = "kv-peer-secret"


def receiver() -> None:
    engine = make_engine(LlamaModel(TINY, tiny_weights(), torch.float32), num_blocks=64, role="decode")
    server = KVTransferServer(KVReceiver(engine, threading.RLock(), lease_s=30), secret=SECRET).start()
    print(server.endpoint, flush=True)
    while True:
        time.sleep(1)


def sender(endpoint: str) -> None:
    client = KVTransferClient(endpoint, timeout_s=30, secret=SECRET)
    res = client.reserve("victim", 40, lease_ms=30_000)
    push = client.push("victim", res, stall_s=60)
    lay = res.layout
    for layer in range(lay.num_layers):
        data = torch.randn(1, 2, 3, lay.block_size, lay.num_kv_heads, lay.head_dim, dtype=DTYPES[lay.dtype])
        push.send(layer, layer + 1, [0, 1, 2], data)
    print("sent", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    if sys.argv[1] == "receiver":
        receiver()
    else:
        sender(sys.argv[2])
