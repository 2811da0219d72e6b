"""A worker engine's performance profile, measured (`tandem profile`) or estimated (roofline):
what the planner's simulator runs on. Stored per node class, as JSON and in Redis."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

PEER_SOURCE = "measured beside a busy peer"  # `tandem profile --beside-busy-peer`'s source


@dataclass(frozen=True)
class PrefillPoint:
    uncached: int  # prompt tokens computed
    cached: int  # prompt tokens read from the prefix cache
    seconds: float


@dataclass(frozen=True)
class DecodePoint:
    batch: int  # requests decoding in the step
    context: int  # their tokens of context, summed
    seconds: float  # one step


@dataclass(frozen=True)
class EngineProfile:
    node_class: str
    source: str  # "measured" or "roofline:<hardware>"
    model: str
    dtype: str
    kv_dtype: str
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    transfer_gbps: dict[str, float] = field(default_factory=dict)  # by transport
    threads: int = 0  # the engine's torch threads (0: not recorded, a profile from before)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> EngineProfile:
        d: dict[str, Any] = json.loads(text)
        prefill = tuple(PrefillPoint(**p) for p in d.pop("prefill"))
        decode = tuple(DecodePoint(**p) for p in d.pop("decode"))
        return cls(prefill=prefill, decode=decode, **d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> EngineProfile:
        return cls.from_json(Path(path).read_text())


class KeyValue(Protocol):
    """The part of a redis.Redis client a profile store uses."""

    def set(self, name: str, value: str) -> Any: ...
    def get(self, name: str) -> Any: ...


def redis_key(namespace: str, node_class: str) -> str:
    return f"tandem:{namespace}:profile:{node_class}"


def store(r: KeyValue, namespace: str, profile: EngineProfile) -> None:
    r.set(redis_key(namespace, profile.node_class), profile.to_json())


def fetch(r: KeyValue, namespace: str, node_class: str) -> EngineProfile | None:
    raw = r.get(redis_key(namespace, node_class))
    if raw is None:
        return None
    return EngineProfile.from_json(raw.decode() if isinstance(raw, bytes) else str(raw))
