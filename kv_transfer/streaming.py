"""Layer-wise KV streaming from a prefill engine.

The engine calls `LayerStreamer.hook` once per step; the callback it returns runs right
after each layer's KV is written, and queues that layer's blocks of every tracked request
in the step. The network thread ships them while the next layers compute:

    step:   layer 0 ──▶ layer 1 ──▶ layer 2 ──▶ ... ──▶ layer 29 ──▶ sample
    send:        └─ L0 ─┘    └─ L1 ─┘    └─ L2 ─┘   ...        └─ L29 ─┘ commit

A chunk sends the blocks it touched; a request's first chunk also sends the blocks a
prefix-cache hit supplied. A block cut by a chunk boundary goes again, complete, with
the next chunk.

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
    first_chunk: bool = True
    wait_s: float = field(default=0.0)


class LayerStreamer:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
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
        work: list[tuple[KVPush, list[int], torch.Tensor]] = []
        for c in out.chunks:
            t = self._tracked.get(c.request.request_id)
            if t is None or c.start >= c.request.num_prompt_tokens:
                continue
            end = min(c.end, c.request.num_prompt_tokens)
            lo = 0 if t.first_chunk else c.start // bs
            t.first_chunk = False
            logical = list(range(lo, (end - 1) // bs + 1))
            table = self.engine.kv.block_table(c.request.request_id)
            work.append((t.push, logical, torch.tensor([table[j] for j in logical])))
        if not work:
            return None
        kv = self.engine.cache.kv

        failed: set[int] = set()

        def on_layer(i: int) -> None:
            for n, (push, logical, src) in enumerate(work):
                if n in failed:
                    continue
                if push.error is not None:  # failed already: skip the copy too
                    failed.add(n)
                    continue
                try:
                    # [1, 2, blocks, block_size, kv_heads, head_dim]: a copy, so later writes can't race the send
                    push.send(i, i + 1, logical, kv[i].index_select(1, src).unsqueeze(0))
                except Exception as e:  # send does not raise; this guards the step all the same
                    failed.add(n)
                    push.abort(f"streaming failed: {type(e).__name__}: {e}")

        return on_layer
