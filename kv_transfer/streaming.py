"""Layer-wise KV streaming from a prefill engine.

The engine calls `LayerStreamer.hook` once per step; the callback it returns runs right
after each layer's KV is written, and queues that layer's blocks of every tracked request
in the step. The network thread ships them while the next layers compute:

    step:   layer 0 ──▶ layer 1 ──▶ layer 2 ──▶ ... ──▶ layer 29 ──▶ sample
    send:        └─ L0 ─┘    └─ L1 ─┘    └─ L2 ─┘   ...        └─ L29 ─┘ commit

A request whose layer is small (a short prompt, or a short chunk of one) sends several layers
at once, at least `min_message_bytes` a message: each message costs the engine thread a
gather, a checksum and a frame, and the receiver a validation and a write, whatever its size.

A chunk sends the blocks it touched; a request's first chunk also sends the blocks a
prefix-cache hit supplied. A block cut by a chunk boundary goes again, complete, with
the next chunk. A step that failed is run again (engine/containment.py), and its chunks go
again whole, a first chunk with its prefix-hit blocks: the receiver rewrites what came twice.

The callback runs on the engine thread under the engine lock, so it never waits on the
network (`KVPush.send` only queues) and nothing it does escapes into the step: any failure
fails that one request's push, whose `commit` raises the typed error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.engine import Engine
from engine.model import LayerCallback
from engine.scheduler import SchedulerOutput
from kv_transfer.sender import KVPush


@dataclass
class _Tracked:
    push: KVPush
    first_chunk: bool = True  # until a chunk's last layer is sent (a failed step's is run again)
    wait_s: float = field(default=0.0)


@dataclass
class _Send:
    """One request's part of a step: its blocks, and the layers it sends a message at a time."""

    tracked: _Tracked
    logical: list[int]
    src: torch.Tensor
    layers: int
    next_layer: int = 0
    failed: bool = False

    @property
    def push(self) -> KVPush:
        return self.tracked.push


# Measured at idle on 2 cores (int8 SmolLM2, a 42-token chat prompt, 36 KiB a layer): one
# message a layer made the prefill worker's part of TTFT ~15 ms longer than a colocated prefill.
MIN_MESSAGE_BYTES = 512 * 1024


class LayerStreamer:
    def __init__(self, engine: Engine, min_message_bytes: int = MIN_MESSAGE_BYTES) -> None:
        self.engine = engine
        self.min_message_bytes = min_message_bytes
        self._tracked: dict[str, _Tracked] = {}
        engine.layer_hook = self.hook

    def track(self, request_id: str, push: KVPush) -> None:
        """Stream this request's KV to `push` as its prefill runs."""
        self._tracked[request_id] = _Tracked(push)

    def untrack(self, request_id: str) -> KVPush | None:
        t = self._tracked.pop(request_id, None)
        return t.push if t else None

    def hook(self, out: SchedulerOutput) -> LayerCallback | None:
        bs = self.engine.config.block_size
        cache = self.engine.cache
        layer_block_bytes = cache.bytes_per_block // cache.num_layers
        work: list[_Send] = []
        for c in out.chunks:
            t = self._tracked.get(c.request.request_id)
            if t is None or c.start >= c.request.num_prompt_tokens:
                continue
            end = min(c.end, c.request.num_prompt_tokens)
            lo = 0 if t.first_chunk else c.start // bs
            logical = list(range(lo, (end - 1) // bs + 1))
            table = self.engine.kv.block_table(c.request.request_id)
            layers = -(-self.min_message_bytes // (len(logical) * layer_block_bytes))
            work.append(_Send(t, logical, torch.tensor([table[j] for j in logical]), max(1, layers)))
        if not work:
            return None
        kv, last = cache.kv, cache.num_layers - 1

        def on_layer(i: int) -> None:
            for w in work:
                if w.failed or (i + 1 - w.next_layer < w.layers and i < last):
                    continue
                if w.push.error is not None:  # failed already: skip the copy too
                    w.failed = True
                    continue
                try:
                    # gathered by the push (a copy, so later writes can't race the send; on shm straight
                    # into shared memory)
                    w.push.send_blocks(w.next_layer, i + 1, w.logical, kv[w.next_layer : i + 1], w.src)
                    w.next_layer = i + 1
                    if i == last:  # a step that fails before this is run again, prefix-hit blocks and all
                        w.tracked.first_chunk = False
                except Exception as e:  # send does not raise; this guards the step all the same
                    w.failed = True
                    w.push.abort(f"streaming failed: {type(e).__name__}: {e}")

        return on_layer
