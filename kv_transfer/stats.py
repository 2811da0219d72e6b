"""Per-request transfer figures, for the TTFT breakdown and the transfer metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransferStats:
    """bytes and chunks moved; seconds from the first chunk to the commit; network_wait_s:
    on the sender, time waiting for the commit's answer (sends never wait); on the
    receiver, time spent waiting for the next message."""

    request_id: str
    bytes: int
    chunks: int
    seconds: float
    network_wait_s: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "request_id": self.request_id,
            "bytes": self.bytes,
            "chunks": self.chunks,
            "seconds": round(self.seconds, 6),
            "gbps": round(self.gbps, 3),
            "network_wait_s": round(self.network_wait_s, 6),
        }
