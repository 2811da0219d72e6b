"""`tandem serve`: start (or join) the cluster, show progress, then serve the router with uvicorn.

Alone it starts local Ray, an embedded redis-server, the pool manager with the workers,
and the router on 127.0.0.1:8000. With RAY_ADDRESS / REDIS_URL set (or --join) it joins
them instead. Ctrl-C or SIGTERM stops the router, then everything this command started.
"""

from __future__ import annotations

import argparse
import os

from engine.config import KV_DTYPES, PREFILL_ATTENTION
from engine.model_files import checkpoint_kind
from router import autoscale_flags


def _port(text: str) -> int:
    if not text.strip().isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0-65535)")
    return int(text)


def _model(text: str) -> str:
    """--model: a path that holds a model (the router reads its tokenizer too), checked before
    anything starts; "" is the bundled one. A path that holds none used to start the cluster
    and fail in each worker, 15 s later, as a directory's missing config.json."""
    if text:
        try:
            checkpoint_kind(text)
        except FileNotFoundError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _workers(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of workers (>= 0)")
    return int(text)


def _blocks(text: str) -> int | None:
    """--num-blocks: a count, or auto (None: sized from the memory where each worker runs)."""
    if text == "auto":
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of blocks (>= 1) or auto")
    return int(text)


def parse(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="tandem serve", description=__doc__)
    ap.add_argument(
        "--model", type=_model, default=env("TANDEM_MODEL", ""), help="GGUF file or HF dir (default: bundled SmolLM2)"
    )
    ap.add_argument("--served-model-name", default="", help="the `model` clients send (default: from the file)")
    ap.add_argument("--host", default=env("TANDEM_HOST", "127.0.0.1"))
    ap.add_argument("--port", type=_port, default=env("TANDEM_PORT", "8000"))  # a str default goes through type
    ap.add_argument("--prefill", type=_workers, default=1, help="prefill workers")
    ap.add_argument("--decode", type=_workers, default=1, help="decode workers")
    ap.add_argument(
        "--colocated",
        nargs="?",
        type=_workers,
        const=1,
        default=0,
        help="serve with N colocated workers instead of P/D (for comparison)",
    )
    ap.add_argument(
        "--dtype",
        default=env("TANDEM_DTYPE", "auto"),
        choices=["auto", "bf16", "fp32", "fp16", "int8", "int4"],
        help="weights and activations: auto picks by CPU (the startup line says what); int4 keeps a Q4_1 GGUF's "
        "layers as stored",
    )
    ap.add_argument(
        "--kv-dtype",
        default=env("TANDEM_KV_DTYPE", "auto"),
        choices=KV_DTYPES,
        help="how KV caches store keys and values, and what P/D moves: auto = as the activations; int8/fp8: "
        "per-token-head scaled codes, about a quarter of fp32's bytes (lossy: see the README)",
    )
    ap.add_argument(
        "--prefill-attention",
        default=env("TANDEM_PREFILL_ATTENTION", "auto"),
        choices=PREFILL_ATTENTION,
        help="prefill chunks' attention kernel on the CPU: auto = int8 (AVX512-VNNI) with int8/int4 weights, "
        "torch's SDPA with float ones; float: bf16 dot products (AVX512-BF16) or fp32 (AVX2)",
    )
    ap.add_argument("--transport", default=env("TANDEM_TRANSPORT", "grpc"), choices=["grpc", "shm", "auto"])
    ap.add_argument(
        "--device",
        default=env("TANDEM_DEVICE", "cpu"),
        choices=["cpu", "cuda", "auto"],
        help="what workers compute on: cuda claims one GPU a worker from Ray (bf16; see the README's GPU "
        "section, not yet run on a GPU); auto: cuda where the worker finds one, claiming none",
    )
    ap.add_argument(
        "--num-blocks",
        type=_blocks,
        default="auto",
        help="KV blocks per worker; auto: a quarter of the host's available memory, split among its workers as "
        "its cores are, at most 2 GiB a worker and at least one full context (a GPU: 80%% of its free memory)",
    )
    chunk_help = "tokens of one prompt a step (so short prompts pass long ones); default 512 on CPU, 0: whole budget"
    ap.add_argument("--max-prefill-chunk", type=int, default=None, help=chunk_help)
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per worker (0: this host's cores split among its workers; with --join, all cores)",
    )
    ap.add_argument(
        "--no-lend-cores",
        action="store_true",
        help="each worker steps on its own threads only (default: the workers of a host lend idle cores)",
    )
    ap.add_argument("--namespace", default=env("TANDEM_NAMESPACE", "default"))
    ap.add_argument(
        "--admin-token", default=env("TANDEM_ADMIN_TOKEN", ""), help="enables /admin (or TANDEM_ADMIN_TOKEN)"
    )
    ap.add_argument("--allow-loopback-admin", action="store_true")
    ap.add_argument("--colocate-below", type=int, default=0, help="uncached prompt tokens under which to skip P/D")
    ap.add_argument(
        "--local-below",
        type=int,
        default=None,
        help="tokens a decode worker lacks of a prompt whose prefix it holds, under which it runs it whole "
        "(0: off; default: RoutingPolicy's)",
    )
    ap.add_argument(
        "--overflow-below",
        type=int,
        default=None,
        help="uncached prompt tokens under which a prompt runs whole on a decode worker while the prefill worker "
        "is backlogged and the decode worker would reach its first token sooner (0: off; default: RoutingPolicy's)",
    )
    ap.add_argument(
        "--spill-streams",
        type=int,
        default=None,
        help="streams a decode worker has over an idle prefill worker from which a short prompt runs whole "
        "on the prefill worker (0: off; default: RoutingPolicy's)",
    )
    ap.add_argument(
        "--no-cross-pool",
        action="store_true",
        help="fail a request (503) rather than run it whole on the other P/D pool when its own has no live worker",
    )
    ap.add_argument(
        "--fast-history",
        action="store_true",
        help="prefill a chat's earlier answers like the rest of its prompt; by default they run as the decode rows "
        "that wrote them, so a turn answers alike with its history cached or not (cold, 1.4-1.8x slower to a first "
        "token when answers are most of the history)",
    )
    ap.add_argument(
        "--speculative",
        default=env("TANDEM_SPECULATIVE", "suffix"),
        choices=["off", "ngram", "suffix"],
        help="decode and colocated workers verify drafts each step, as many as pay at the step's load: ngram = "
        "prompt lookup, suffix (default) = that and the worker's recent outputs; the same tokens as off where a "
        "row's result does not depend on its step (fp32; int8 with AVX512-VNNI)",
    )
    ap.add_argument(
        "--write-back",
        action="store_true",
        help="after each P/D turn, copy the answer's KV from the decode worker to the prefill worker's cache",
    )
    ap.add_argument(
        "--max-running",
        type=int,
        default=None,
        help="requests the router runs at once (default: 64 for each decode or colocated worker up, as pools change)",
    )
    ap.add_argument(
        "--max-attempts",
        type=int,
        default=None,
        help="pairs a request is tried on while it has no token yet, each time a worker dies or freezes under "
        "it, before a 503 (default 2, at most 5)",
    )
    ap.add_argument(
        "--max-migrations",
        type=int,
        default=2,
        help="times a stream moves to another pair mid-answer, each time a worker dies or freezes under it, "
        "before it ends in an error (default 2)",
    )
    ap.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="max_tokens for a request that sets none (default: as OpenAI's API: chat the rest of the context, "
        "completions 16)",
    )
    ap.add_argument(
        "--queue-timeout",
        type=float,
        default=600.0,
        help="seconds a request may wait, for an admission slot and for a worker with room, before a 429 "
        "(default: the OpenAI SDK's own timeout)",
    )
    ap.add_argument("--join", action="store_true", help="join the Ray cluster at RAY_ADDRESS (default: auto)")
    ap.add_argument(
        "--stop-pools",
        action="store_true",
        help="on a joined cluster with a shared Redis (REDIS_URL), stop the pools with this router "
        "(default: leave them to the cluster and its other routers)",
    )
    ap.add_argument("--kv-tls-cert", default=env("TANDEM_KV_TLS_CERT"), help="PEM certificate: TLS on the KV channel")
    ap.add_argument("--kv-tls-key", default=env("TANDEM_KV_TLS_KEY"), help="PEM private key of --kv-tls-cert")
    ap.add_argument("--kv-tls-ca", default=env("TANDEM_KV_TLS_CA"), help="PEM CA: verify peers (mutual TLS)")
    autoscale_flags.add_arguments(ap)
    args = ap.parse_args(argv)
    joins = args.join or "RAY_ADDRESS" in os.environ or "REDIS_URL" in os.environ  # pools may be there already
    if not (args.prefill or args.decode or args.colocated or joins):
        ap.error("no workers to serve with: --prefill and --decode (or --colocated N) must name one at least")
    return args
