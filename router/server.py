"""`tandem serve`: start (or join) the cluster, show progress, then serve the router with
uvicorn; stop it all on Ctrl-C or SIGTERM (router/stopping.py). Its flags: router/serve_args.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, NoReturn

import pydantic
import uvicorn

from cluster.start_failures import WorkersCannotStart
from router import autoscale_flags, stopping
from router.port_check import PortUnavailable, check_port_free
from router.ray_watch import RayWatch, watch_ray
from router.serve_args import parse
from router.serve_progress import kv_room, progress
from router.settings import RouterSettings

if TYPE_CHECKING:
    from router.autoscaler import Planner

EXAMPLE = """\
Tandem is serving {model} at {url}
  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 128}}'
Press Ctrl-C to stop."""


FLAGS = {"max_running": "--max-running", "max_attempts": "--max-attempts", "queue_timeout_s": "--queue-timeout",
         "colocate_below_tokens": "--colocate-below", "local_below_tokens": "--local-below",
         "overflow_below_tokens": "--overflow-below", "spill_streams": "--spill-streams"}  # fmt: skip


def _settings(args: argparse.Namespace) -> RouterSettings:
    """The router's settings from the flags (and TANDEM_* variables). Raises SystemExit, with one
    line a bad value, for any the settings refuse."""
    try:
        return RouterSettings.from_env(
            host=args.host,
            port=args.port,
            model_name=args.served_model_name,
            max_running=args.max_running,
            **({"max_attempts": args.max_attempts} if args.max_attempts is not None else {}),
            default_max_tokens=args.default_max_tokens,
            queue_timeout_s=args.queue_timeout,
            colocate_below_tokens=args.colocate_below,
            **({"local_below_tokens": args.local_below} if args.local_below is not None else {}),
            **({"overflow_below_tokens": args.overflow_below} if args.overflow_below is not None else {}),
            **({"spill_streams": args.spill_streams} if args.spill_streams is not None else {}),
            **({"cross_pool": False} if args.no_cross_pool else {}),
            **({"exact_history": False} if args.fast_history else {}),
            allow_loopback_admin=args.allow_loopback_admin,
            **({"admin_token": args.admin_token} if args.admin_token else {}),
        )
    except pydantic.ValidationError as e:
        bad = (f"{FLAGS.get(str(err['loc'][0]), '--' + str(err['loc'][0]).replace('_', '-'))}: {err['msg']}"
               for err in e.errors())  # fmt: skip
        raise SystemExit("tandem serve: " + "; ".join(bad)) from None


def _leave_ray(message: str, code: int) -> NoReturn:
    """Disconnect from a Ray that ray.init started or joined (bounded), and exit past its hook."""
    import ray

    from cluster.shutdown import Step, run_steps

    run_steps([Step("ray", ray.shutdown, ray=True)])
    print(message, flush=True)
    stopping.exit_past_ray(code)


def _sizes(cluster: Any) -> str:
    return ", ".join(f"{n} {role}" for role, n in cluster.state.desired().items() if n) or "no workers"


def _watch_ray(stop: threading.Event) -> RayWatch:
    """Once the Ray cluster (`ray down`) or this host's raylet is gone, stop serving (router.ray_watch)."""

    def gone(what: str) -> None:
        print(f"{what}; stopping", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    return watch_ray(stop, gone)


def http_server(app: Any, settings: RouterSettings) -> uvicorn.Server:
    """The router's HTTP server. On SIGTERM or Ctrl-C it stops accepting connections and lets
    every answer in flight finish before `run()` returns (a second Ctrl-C cuts them short)."""
    # lifespan off: the app has no startup or shutdown handlers, and uvicorn's lifespan task,
    # cancelled by Ctrl-C, logged a traceback on every stop
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", lifespan="off")
    return uvicorn.Server(config)


def _kv_tls(args: argparse.Namespace) -> Any:
    """The KV channel's TLS files, or None for plaintext. Raises SystemExit on a bad combination."""
    if not (args.kv_tls_cert or args.kv_tls_key or args.kv_tls_ca):
        return None
    from kv_transfer.security import KVTLSConfig

    if not (args.kv_tls_cert and args.kv_tls_key):
        raise SystemExit("tandem serve: TLS on the KV channel needs --kv-tls-cert and --kv-tls-key")
    try:
        return KVTLSConfig(args.kv_tls_cert, args.kv_tls_key, args.kv_tls_ca)
    except ValueError as e:
        raise SystemExit(f"tandem serve: --kv-tls-*: {e}") from None


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:  # before Ray, Redis or a worker starts: a taken port is not worth minutes of startup
        check_port_free(args.host, args.port)
    except PortUnavailable as e:
        raise SystemExit(f"tandem serve: {e}") from None
    try:
        autoscale = autoscale_flags.config_from_args(args)
    except ValueError as e:
        raise SystemExit(f"tandem serve: {e}") from None
    if args.join:
        os.environ.setdefault("RAY_ADDRESS", "auto")
    from cluster.cluster import Cluster, ClusterConfig
    from cluster.manager_link import CannotJoinError
    from engine.config import EngineConfig
    from engine.torch_threads import oversubscribed, threads_per_worker

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = _settings(args)
    prefill, decode = (0, 0) if args.colocated else (args.prefill, args.decode)
    one_host = not args.join and "RAY_ADDRESS" not in os.environ  # every worker on this host
    threads = args.threads
    if not threads and one_host:
        threads = threads_per_worker(os.cpu_count() or 1, prefill + decode + args.colocated)
    elif one_host and (crowded := oversubscribed(threads, prefill + decode + args.colocated, os.cpu_count() or 1)):
        print(f"tandem: {crowded}", flush=True)
    planner = None
    if autoscale is not None:
        from planner.autoscale import Host, fit_bounds
        from router.autoscaler import planner_from_args

        try:
            host = Host(os.cpu_count() or 1, threads, not args.no_lend_cores) if one_host else None
        except ValueError as e:
            raise SystemExit(f"tandem serve: --threads: {e}") from None
        if host is not None:  # more workers than its cores hold would only share them
            bounds, said = fit_bounds(autoscale.bounds, host)
            autoscale = dataclasses.replace(autoscale, bounds=bounds)
            if said:
                print(f"tandem: autoscaling on this host's {host.cores} cores, {host.threads} thread(s) a worker: "
                      + "; ".join(said), flush=True)  # fmt: skip
        try:  # the profiles are read now: one that does not fit is a line before any start
            planner = planner_from_args(args, autoscale, host)
        except ValueError as e:
            raise SystemExit(f"tandem serve: --autoscale-profile: {e}") from None
    try:  # a bad engine or pool option: one line, not a traceback
        config = ClusterConfig(
            model_path=args.model,
            namespace=args.namespace,
            prefill=prefill,
            decode=decode,
            colocated=args.colocated,
            engine=EngineConfig(
                dtype=args.dtype,
                num_blocks=args.num_blocks,
                max_prefill_chunk=args.max_prefill_chunk,
                num_threads=threads or None,
                lend_cores=not args.no_lend_cores,
                speculative="" if args.speculative == "off" else args.speculative,
                kv_dtype=args.kv_dtype,
                device=args.device,
                prefill_attention=args.prefill_attention,
            ),
            transport=args.transport,
            kv_tls=_kv_tls(args),
            write_back=args.write_back,
            max_migrations=args.max_migrations,
            keep_pools=False if args.stop_pools else None,
        )
    except ValueError as e:
        raise SystemExit(f"tandem serve: {e}") from None
    started = time.monotonic()
    dtype = f"auto -> {config.engine.weight_dtype}" if args.dtype == "auto" else args.dtype  # as on this host
    kv = f"auto -> {config.engine.kv_storage}" if args.kv_dtype == "auto" else args.kv_dtype
    print(
        f"tandem: starting {prefill} prefill, {decode} decode, {args.colocated} colocated worker(s) "
        f"({dtype}, {f'{threads} threads each' if threads else 'all cores each'}, KV {kv} over "
        f"{args.transport}) ...",
        flush=True,
    )
    signals = stopping.StartSignals()
    signals.listen()
    try:
        cluster = Cluster.connect(config, on_ray_started=signals.listen)  # Ray put its own SIGTERM handler in
    except SystemExit as e:
        if e.code != signal.SIGTERM:
            raise
        # SIGTERM inside ray.init, through the handler it put in: Ray is half up, and its exit
        # hook aborted on that at times (exit 134). Stop it here, bounded, and exit past the hook.
        _leave_ray("tandem: stopped", 0)
    except CannotJoinError as e:
        _leave_ray(f"tandem serve: {e}", 2)
    if cluster.joined_pools:
        print(f"tandem: joined the pools running in namespace {args.namespace!r} ({_sizes(cluster)}): their "
              "sizes, engine and transport stand (the flags above apply to new pools only)", flush=True)  # fmt: skip
    loaded, stop = threading.Event(), threading.Event()  # stop: ends the Ray-watch and autoscaler threads
    watch = _watch_ray(stop)
    code = 0
    try:
        threading.Thread(target=progress, args=(cluster, loaded, started), daemon=True).start()
        if cluster.wait_ready(stop=signals.requested):
            loaded.set()
            code = _route(cluster, settings, args, autoscale, planner, started, stop, signals)
    except (WorkersCannotStart, TimeoutError) as e:  # the pools never came up: say why, no traceback
        print(f"tandem serve: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        stopping.absorb_stop_signals()
        loaded.set()
        stop.set()
        print("tandem: shutting down ...", flush=True)
        # a joined Ray's GCS gone: every Ray call would block. Ray of this command's own: its bounded
        # steps still stop what answers, and ray.shutdown the processes it started; a GCS refusing
        # connections (a whole-group SIGTERM, as `systemctl stop` sends) skips them (`ray_down`)
        ray_gone = watch.gone.is_set() and cluster.joined_ray
        if watch.gone.is_set():
            code = 1  # not a stop anyone asked for: a supervisor restarts it
        if cluster.keeps_pools and not ray_gone:
            print("tandem: leaving the pools running for the cluster and its other routers (--stop-pools: "
                  "stop them)", flush=True)  # fmt: skip
        outcome = cluster.shutdown(ray_gone=ray_gone, ray_down=watch.gcs_refuses)
        print("tandem: stopped", flush=True)
    if not outcome.ray_answered:
        stopping.exit_past_ray(code)
    return code


def _route(
    cluster: Any,
    settings: RouterSettings,
    args: argparse.Namespace,
    autoscale: autoscale_flags.AutoscaleConfig | None,
    planner: Planner | None,
    started: float,
    stop: threading.Event,
    signals: stopping.StartSignals,
) -> int:
    """Serve the API until a stop signal; 1 if the port could not be bound after all."""
    from router.app import create_app
    from router.backend import ClusterBackend

    backend = ClusterBackend(cluster, settings.routing_policy)
    app = create_app(backend, settings)
    if autoscale is not None:
        from router import autoscaler
        from router.window_share import RedisWindowShare

        share = RedisWindowShare(cluster.state, autoscale.interval_s)  # one router decides over all of theirs
        autoscaler.start(autoscale, backend, app.state.dispatcher.window, stop, planner, share)
        print(f"autoscaling within {args.autoscale} every {autoscale.interval_s:g} s (SLO {args.slo})", flush=True)
    url = f"http://{settings.host}:{settings.port}"
    print(f"ready in {time.monotonic() - started:.1f} s{kv_room(cluster)}", flush=True)
    print(EXAMPLE.format(model=backend.model.name, url=url), flush=True)
    server = http_server(app, settings)
    if signals.requested.is_set():  # since the cluster was ready
        return 0
    server.run()  # uvicorn takes the signals while it serves, and on its way out raises each again
    return 0 if server.started else 1  # not started: uvicorn logged why (the port taken since, say)


if __name__ == "__main__":
    raise SystemExit(main())
