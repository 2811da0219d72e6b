"""Can `tandem serve` listen where it was told to? Checked before anything starts, so a taken
port costs a second, not minutes of cluster start-up."""

from __future__ import annotations

import errno
import os
import socket
import sys


class PortUnavailable(Exception):
    """The router's host:port cannot be bound: a socket listens on it, the host is not local, ..."""

    def __init__(self, host: str, port: int, error: OSError) -> None:
        self.host, self.port, self.errno = host, port, error.errno
        reason, where = error.strerror or str(error), host or "all interfaces"
        if error.errno == errno.EADDRINUSE:
            super().__init__(f"port {port} on {where} is taken ({reason}); pick another with --port")
        else:
            super().__init__(f"cannot listen on port {port} on {where} ({reason}); check --host and --port")


def check_port_free(host: str, port: int) -> None:
    """Bind host:port the way uvicorn will (asyncio's create_server), then let it go.
    Raises PortUnavailable.

    Every address the host resolves to is bound with SO_REUSEADDR on POSIX, as asyncio does:
    a port left in TIME_WAIT by a server that just stopped counts as free, and only one that a
    socket listens on counts as taken."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # a family this host lacks (IPv6 off): asyncio skips it too
                continue
            with sock:
                if os.name == "posix" and sys.platform != "cygwin":
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
    except OSError as e:
        raise PortUnavailable(host, port, e) from e
