"""The KV transfer part of a profile: GB/s per transport, by `tandem bench transfer`'s method
(a 4K-token prompt's blocks to a decode engine in its own process)."""

from __future__ import annotations

from dataclasses import replace

from bench.transfer_bench import measure_transfers
from bench.transfer_peer import DecodePeer
from engine.config import EngineConfig
from engine.engine import Engine
from planner.profile import EngineProfile


def transfer_gbps(profile: EngineProfile, source: Engine, path: str, transports: list[str]) -> EngineProfile:
    cfg = source.config
    decode_cfg = EngineConfig(dtype=cfg.dtype, kv_dtype=cfg.kv_dtype, num_blocks=cfg.num_blocks, role="decode")
    peer = DecodePeer(None, path, decode_cfg, cfg.num_threads or 1)
    try:
        res, _ = measure_transfers(source, peer, transports, runs=3)
    finally:
        peer.close()
    return replace(profile, transfer_gbps={t: v for t in transports if (v := res.get(f"{t}_gbps_4k")) is not None})
