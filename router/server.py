"""`tandem router`: start (or join) the cluster, then serve the router with uvicorn."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from router.settings import RouterSettings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem router", description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default="", help="GGUF file or HF directory (default: bundled SmolLM2)")
    ap.add_argument("--served-model-name", default="", help="the `model` clients send (default: from the file)")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--colocated", type=int, default=0)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16", "int8"])
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--colocate-below", type=int, default=0, help="uncached prompt tokens under which to skip P/D")
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--allow-loopback-admin", action="store_true")
    args = ap.parse_args(argv)

    from cluster.cluster import Cluster, ClusterConfig
    from cluster.routing import RoutingPolicy
    from engine.config import EngineConfig
    from router.app import create_app
    from router.backend import ClusterBackend

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = RouterSettings.from_env(
        host=args.host,
        port=args.port,
        model_name=args.served_model_name,
        max_running=args.max_running,
        colocate_below_tokens=args.colocate_below,
        allow_loopback_admin=args.allow_loopback_admin,
    )
    config = ClusterConfig(
        model_path=args.model,
        namespace=args.namespace,
        prefill=args.prefill,
        decode=args.decode,
        colocated=args.colocated,
        engine=EngineConfig(dtype=args.dtype, num_blocks=args.num_blocks),
    )
    print(f"starting the cluster ({args.prefill} prefill, {args.decode} decode, {args.colocated} colocated) ...")
    cluster = Cluster.connect(config)
    try:
        cluster.wait_ready()
        backend = ClusterBackend(cluster, RoutingPolicy(colocate_below_tokens=settings.colocate_below_tokens))
        app = create_app(backend, settings)
        uvicorn.run(app, host=settings.host, port=settings.port, log_level="info")
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
