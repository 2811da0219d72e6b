"""`tandem admin`: the router's admin API from the shell (token from TANDEM_ADMIN_TOKEN)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import httpx


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem admin", description=__doc__)
    ap.add_argument("--url", default=os.environ.get("TANDEM_ROUTER_URL", "http://127.0.0.1:8000"))
    sub = ap.add_subparsers(dest="op", required=True)
    sub.add_parser("pools", help="workers per pool: role, node, load, KV usage, state")
    scale = sub.add_parser("scale", help="set a pool's size")
    scale.add_argument("role", choices=["prefill", "decode", "colocated"])
    scale.add_argument("replicas", type=int)
    scale.add_argument("--force", action="store_true", help="even if no pool could serve requests afterwards")
    drain = sub.add_parser("drain", help="drain one worker (it finishes its requests, then stops)")
    drain.add_argument("worker_id")
    flip = sub.add_parser("flip", help="turn a prefill worker into a decode worker or back, in place")
    flip.add_argument("worker_id")
    flip.add_argument("role", choices=["prefill", "decode"])
    flip.add_argument("--force", action="store_true", help="even if no pool could serve requests afterwards")
    rebalance = sub.add_parser("rebalance", help="set the prefill and decode pool sizes together")
    rebalance.add_argument("prefill", type=int)
    rebalance.add_argument("decode", type=int)
    rebalance.add_argument("--force", action="store_true", help="even if no pool could serve requests afterwards")
    args = ap.parse_args(argv)

    force = {"force": True} if getattr(args, "force", False) else {}
    calls: dict[str, tuple[str, str, dict[str, Any] | None]] = {
        "pools": ("GET", "/admin/pools", None),
        "scale": (
            "POST",
            f"/admin/pools/{getattr(args, 'role', '')}",
            {"replicas": getattr(args, "replicas", 0), **force},
        ),
        "drain": ("POST", f"/admin/workers/{getattr(args, 'worker_id', '')}/drain", None),
        "flip": (
            "POST",
            f"/admin/workers/{getattr(args, 'worker_id', '')}/role",
            {"role": getattr(args, "role", ""), **force},
        ),
        "rebalance": (
            "POST",
            "/admin/rebalance",
            {"prefill": getattr(args, "prefill", 0), "decode": getattr(args, "decode", 0), **force},
        ),
    }
    method, path, body = calls[args.op]
    token = os.environ.get("TANDEM_ADMIN_TOKEN", "")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.request(method, args.url.rstrip("/") + path, json=body, headers=headers, timeout=30)
    except httpx.HTTPError as e:
        print(f"tandem admin: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    try:
        data = r.json()
    except ValueError:
        data = {"error": {"message": r.text}}
    if r.status_code >= 400:
        message = data.get("error", {}).get("message", r.text) if isinstance(data, dict) else r.text
        print(f"tandem admin: {r.status_code}: {message}", file=sys.stderr)
        if isinstance(data, dict) and data.get("error", {}).get("code") == "would_stop_serving":
            print("tandem admin: add --force to do it anyway", file=sys.stderr)
        return 1
    print(json.dumps(data, indent=2))
    return 0
