"""Who may call the KV endpoint, and the optional TLS of its channel.

    Reserve   cluster secret in the `x-tandem-secret` metadata (refused if the server has none)
    Push      the reservation's one-time transfer token, in every chunk header
    Release   the reservation's one-time transfer token
    Health    anyone

Secrets and tokens are compared in constant time, so the time taken does not tell how much
of a guess was right.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc

SECRET_HEADER = "x-tandem-secret"


def same_secret(given: str | None, expected: str | None) -> bool:
    """True if both are set and equal; constant time in the length of `expected`."""
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


@dataclass(frozen=True)
class KVTLSConfig:
    """PEM files for TLS on the KV channel.

    Server: `cert_file` + `key_file` are its identity; with `ca_file` it also requires client
    certificates signed by that CA (mutual TLS). Client: `ca_file` verifies the server (None:
    the system roots); with `cert_file` + `key_file` it presents its own certificate."""

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        for f in (self.cert_file, self.key_file, self.ca_file):
            if f is not None and not Path(f).is_file():
                raise ValueError(f"TLS file {f!r} does not exist")

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert_file is None or self.key_file is None:
            raise ValueError("a TLS server needs cert_file and key_file")
        pair = (_read(self.key_file), _read(self.cert_file))
        ca = _read(self.ca_file) if self.ca_file else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file) if self.ca_file else None,
            private_key=_read(self.key_file) if self.key_file else None,
            certificate_chain=_read(self.cert_file) if self.cert_file else None,
        )


def _read(path: str) -> bytes:
    return Path(path).read_bytes()
