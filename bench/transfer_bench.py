"""`tandem bench transfer`: KV transfer GB/s per transport against TCP loopback and memcpy,
and what layer-wise P/D transfer adds to the time to first token.

    prefill side (this process)                    decode side (a spawned process by default)
    SmolLM2 cache, random blocks ──send/layer──▶ KVTransferServer ─▶ KVReceiver ─▶ decode cache
                                 ──commit─────▶                    (admit + first decode step)

Transfers time first send to commit returning; the per-layer gather out of the paged cache
is inside that time (`KVPush.send_blocks`). On shm the decode side's cache lives in /dev/shm,
as a decode worker's does, and the sender copies each layer straight into the reserved blocks
(kv_transfer/in_place.py): the payload's one copy. `shm_copy` is the same transport without
that, through the sender's segments: copied once a side.
Each transport's GB/s is also a ratio to the memcpy measured in the same run (`--json`:
`<transport>_over_memcpy` for 4K, `<transport>_over_memcpy_<size>`). Every figure is the
best of a few runs after a warm-up: the machine may be shared, and others' load only ever
makes a run slower. The decode side runs in a spawned process with its own copy of the model,
so the two sides do not share a GIL; `--receiver thread` puts it in this process on the same
model object, to see what sharing costs. The collective transport (kv_transfer/collective.py, gloo on CPU)
is measured only where that module exists and connects; otherwise the output says why not.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import threading
import time
from collections.abc import Callable

import torch

from bench.json_out import print_json
from bench.transfer_peer import LINK_TIMEOUT_S, DecodePeer
from bench.transfer_ttft import TTFT_KEYS, TTFT_TOKENS, measure_ttft
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model_files import default_model_path
from kv_transfer.in_place_writer import InPlaceWriter
from kv_transfer.sender import KVTransferClient

MB = 1 << 20
SIZES = {"1k": 1024, "4k": 4096}
TRANSPORTS = ("grpc", "shm", "shm_copy", "collective")


def best_of(fn: Callable[[], float], runs: int) -> float:
    """The least seconds `fn` reports over `runs` runs, after one warm-up."""
    fn()
    return min(fn() for _ in range(runs))


# ---- baselines ------------------------------------------------------------------------------


def tcp_gbps(total: int = 256 * MB, chunk: int = MB) -> float:
    """One 127.0.0.1 stream, a sender thread doing `chunk`-byte sendall, this thread recv_into.

    A thread, not a process: both sides spend their time in syscalls, which release the GIL."""

    def once() -> float:
        with socket.create_server(("127.0.0.1", 0)) as srv:
            port = srv.getsockname()[1]

            def send() -> None:
                payload = memoryview(bytes(chunk))
                with socket.create_connection(("127.0.0.1", port)) as s:
                    for _ in range(total // chunk):
                        s.sendall(payload)

            t = time.perf_counter()
            sender = threading.Thread(target=send, daemon=True)
            sender.start()
            conn, _ = srv.accept()
            with conn:
                view, got = memoryview(bytearray(chunk)), 0
                while got < total:
                    n = conn.recv_into(view)
                    if not n:
                        raise ConnectionError("TCP baseline: the sender closed early")
                    got += n
            dt = time.perf_counter() - t
            sender.join()
        return dt

    return total / best_of(once, 3) / 1e9


def memcpy_gbps(nbytes: int = 256 * MB) -> float:
    """Bytes copied per second by torch `copy_` (reads + writes = twice that in memory traffic)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)

    def copy() -> float:
        t = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t

    return nbytes / best_of(copy, 5) / 1e9


# ---- transfers ------------------------------------------------------------------------------


def transfer_s(client: KVTransferClient, source: Engine, blocks: list[int], rid: str) -> float:
    """Push the KV of `blocks` (every layer) layer by layer, commit, release; seconds from first send to commit."""
    cache = source.cache
    n_tokens = len(blocks) * cache.block_size
    res = client.reserve(rid, n_tokens)
    try:
        push = client.push(rid, res)
        if isinstance(push.writer, InPlaceWriter):  # in serving its claim is answered while layer 0 computes
            push.writer.wait_claimed(30)
        src, logical = torch.tensor(blocks), list(range(len(blocks)))
        t = time.perf_counter()
        for i in range(cache.num_layers):
            # kv[i : i + 1]: [1, 2, num_blocks, block_size, kv_heads, head_dim]; the push gathers `src`
            push.send_blocks(i, i + 1, logical, cache.kv[i : i + 1], src)
        result = push.commit(n_tokens)
        dt = time.perf_counter() - t
    finally:
        client.release(rid, res.transfer_token, "bench done")
    assert result.bytes == len(blocks) * cache.bytes_per_block, (result.bytes, len(blocks))
    return dt


def transport_gbps(
    client: KVTransferClient, source: Engine, blocks: list[int], runs: int, name: str = ""
) -> dict[str, float | None]:
    """`name`_gbps_<size> (default name: the client's transport) of pushes out of `source`."""
    ids = iter(range(1 << 30))
    out: dict[str, float | None] = {}
    for size, n_tokens in SIZES.items():
        b = blocks[: n_tokens // source.cache.block_size]

        def once(b: list[int] = b) -> float:
            return transfer_s(client, source, b, f"{client.transport}-{next(ids)}")

        out[f"{name or client.transport}_gbps_{size}"] = (
            len(b) * source.cache.bytes_per_block / best_of(once, runs) / 1e9
        )
    return out


def collective_gbps(
    decode: DecodePeer, source: Engine, blocks: list[int], runs: int
) -> tuple[dict[str, float | None], str]:
    """The collective transport (gloo on CPU) if kv_transfer/collective.py exists and works;
    otherwise nulls and why it was skipped."""
    empty: dict[str, float | None] = {"collective_gbps_1k": None, "collective_gbps_4k": None}
    if importlib.util.find_spec("kv_transfer.collective") is None:
        return empty, "kv_transfer/collective.py absent"
    link = None
    try:  # a module still being written: report what failed, keep the other figures
        coll = importlib.import_module("kv_transfer.collective")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        outcome = decode.open_collective(port)
        try:
            link = coll.CollectiveLink.connect(coll.LinkConfig(port, timeout_s=LINK_TIMEOUT_S), coll.SENDER)
        finally:
            why = outcome()  # always read the worker's answer, so the pipe stays in step
        if why:
            raise RuntimeError(f"receiving end: {why}")
        client = KVTransferClient(decode.endpoint, "collective", timeout_s=30, link=link, secret=decode.secret)
        try:
            return transport_gbps(client, source, blocks, runs), ""
        finally:
            client.close()
    except Exception as e:
        return empty, f"{type(e).__name__}: {e}"
    finally:
        if link is not None:
            link.close()


# ---- entry point ----------------------------------------------------------------------------


def measure_transfers(
    source: Engine, decode: DecodePeer, transports: list[str], runs: int
) -> tuple[dict[str, float | None], str]:
    """GB/s of each transport for the 1K and 4K prompts, from random KV in `source`'s cache."""
    res: dict[str, float | None] = {}
    skipped = ""
    blocks = source.reserve("bench-source", SIZES["4k"])
    cache = source.cache
    # kv[:, :, blocks]: [layers, 2, blocks, block_size, kv_heads, width], coded as the cache codes
    shape = (cache.num_layers, 2, len(blocks), cache.block_size, cache.num_kv_heads, cache.head_dim)
    cache.kv[:, :, torch.tensor(blocks)] = cache.codec.encode(torch.randn(shape))
    try:
        for t in transports:
            if t == "collective":
                got, skipped = collective_gbps(decode, source, blocks, runs)
            else:
                kind = "shm" if t == "shm_copy" else t
                client = KVTransferClient(
                    decode.endpoint, kind, timeout_s=30, secret=decode.secret, in_place=t != "shm_copy"
                )
                got = transport_gbps(client, source, blocks, runs, t)
                client.close()
            res |= got
    finally:
        source.release("bench-source")
    return res, skipped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench transfer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "int8"], help="int8: W8A8 (KV auto: bf16)")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "fp32", "bf16", "int8", "fp8"], help="KV cache")
    ap.add_argument("--transports", default=",".join(TRANSPORTS), help=f"comma-separated: {', '.join(TRANSPORTS)}")
    ap.add_argument("--receiver", default="process", choices=["process", "thread"], help="decode side placement")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5, help="timed runs per transfer figure (TTFT: 3)")
    ap.add_argument("--quick", action="store_true", help="smoke check: transfer figures only (no TTFT), 3 runs")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    runs = 3 if args.quick else args.runs
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if bad := sorted(set(transports) - set(TRANSPORTS)):
        ap.error(f"unknown transports {bad}; choose from {', '.join(TRANSPORTS)}")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = str(default_model_path())
    # room for the 4K-token source, or for one 2K-token TTFT prompt at a time
    blocks = SIZES["4k"] // EngineConfig.block_size + 64
    cfg = EngineConfig(dtype=args.dtype, num_blocks=blocks, role="prefill", kv_dtype=args.kv_dtype)
    decode_cfg = EngineConfig(dtype=args.dtype, num_blocks=blocks, role="decode", kv_dtype=args.kv_dtype)
    spawned = DecodePeer(None, path, decode_cfg, args.threads) if args.receiver == "process" else None
    source = Engine.from_path(path, cfg)  # while the spawned worker loads its own copy
    decode = spawned or DecodePeer(source.model, path, decode_cfg, args.threads)
    ttft_transport = "grpc" if "grpc" in transports or "shm" not in transports else "shm"
    try:
        res: dict[str, float | None] = {"tcp_gbps": tcp_gbps(), "memcpy_gbps": memcpy_gbps()}
        got, skipped = measure_transfers(source, decode, transports, runs)
        res |= got | (dict.fromkeys(TTFT_KEYS) if args.quick else measure_ttft(source, decode, ttft_transport))
    finally:
        decode.close()
    res |= over_memcpy(res)
    meta = {
        "kv_dtype": source.cache.codec.kind,
        "threads": args.threads,
        "receiver": args.receiver,
        "stat": f"best of {runs} (transfers)" + ("" if args.quick else ", of 3 (TTFT)"),
        "ttft_transport": ttft_transport,
        "collective_skipped": skipped or None,
    }
    if args.json:
        print_json(meta | {k: round(v, 4) if v is not None else None for k, v in res.items()})
    else:
        print_table(res, meta)
    return 0


def over_memcpy(res: dict[str, float | None]) -> dict[str, float | None]:
    """Each transport's GB/s per size, the 4K figure unsuffixed, and each as a ratio to memcpy."""
    out: dict[str, float | None] = {}
    mem = res["memcpy_gbps"]
    for t in TRANSPORTS:
        for size in ("", *(f"_{s}" for s in SIZES)):
            v = res.get(f"{t}_gbps{size or '_4k'}")
            out[f"{t}_gbps{size}"] = v
            out[f"{t}_over_memcpy{size}"] = v / mem if v is not None and mem else None
    return out


def print_table(res: dict[str, float | None], meta: dict[str, object]) -> None:
    tcp, mem = res["tcp_gbps"] or 1.0, res["memcpy_gbps"] or 1.0
    where = "a spawned process (own GIL)" if meta["receiver"] == "process" else "this process (shared GIL)"
    print(f"transfer bench: {meta['kv_dtype']} KV, {meta['threads']} threads, receiver in {where}, {meta['stat']}")
    print(f"{'metric':<42}{'GB/s':>8}{'vs TCP':>9}{'vs memcpy':>11}")
    rows = [("TCP loopback, 256 MB in 1 MB writes", "tcp_gbps"), ("memcpy, torch copy_ of 256 MB", "memcpy_gbps")]
    for t in TRANSPORTS:
        rows += [(f"{t}, 1K-token prompt KV", f"{t}_gbps_1k"), (f"{t}, 4K-token prompt KV", f"{t}_gbps_4k")]
    for label, key in rows:
        v = res[key]
        if v is not None:
            print(f"{label:<42}{v:>8.2f}{v / tcp:>8.2f}x{v / mem:>10.2f}x")
            continue
        why = meta["collective_skipped"] if key.startswith("collective") else None
        print(f"{label:<42}{'-':>8}  ({why or 'not run'})")
    if res["ttft_with_transfer_s"] is None:
        return
    a, b = res["ttft_with_transfer_s"] or 0.0, res["ttft_prefill_only_s"] or 1.0
    print(f"\n{f'TTFT, {TTFT_TOKENS // 1024}K-token prompt':<42}{'seconds':>8}")
    print(f"{'prefill alone (no streaming)':<42}{b:>8.3f}")
    label = f"prefill + {meta['ttft_transport']} stream + admit + 1 decode"
    print(f"{label:<42}{a:>8.3f}  ({100 * (a / b - 1):+.1f}%)")
    for k, label in [
        ("prefill", "  of which prefill, streaming"),
        ("queue", "    in it, blocked on a full send queue"),
        ("commit", "  of which commit wait"),
        ("decode", "  of which admit + first decode step"),
    ]:
        print(f"{label:<42}{res[f'ttft_{k}_s'] or 0.0:>8.3f}")
