"""The Ray actors: each holds one worker, its calls on lanes, registration in Redis (cluster.registration).
Prefill and decode workers are one actor class, PDActor, which flips between the two roles in place.

Actors are threaded, with three lanes (Ray concurrency groups), so that no control call ever
waits behind generation:

    default  max 64   start / prefill / reserve / write-back: one thread per call, held for its length
    health   max 4    ping, drain: touch no lock, answer within milliseconds however busy
    control  max 16   idle, abort, release, renew, stats, check_integrity: one engine step at most
    feed     max 8    take_outputs / attach_feed: a router's long poll for its requests' outputs
                      (engine/outbox.py), or the socket they are pushed down (cluster/feed_channel.py)

cluster/worker_actors.py starts them (0 CPUs and one slot of their role's custom resource, so
placement follows the `prefill` / `decode` / `colocated` slots nodes advertise), finds and kills them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast

import ray

from cluster.config import bind_host
from cluster.feed_channel import Pushers
from cluster.registration import PublishesBlocks, Registered
from engine.config import EngineConfig
from engine.errors import WorkerDraining
from kv_transfer.security import KVTLSConfig

# The workers (the engine, torch) are imported where an actor runs: the pool manager imports these
# classes to start actors, first thing (its imports: 2.1 s with the engine, 0.4 s without).
if TYPE_CHECKING:
    from decode_workers.colocated import ColocatedWorker
    from decode_workers.worker import DecodeWorker
    from engine.messages import TokenOutput
    from engine.outbox import Item
    from engine.outputs import RequestOutput
    from engine.worker_base import WorkerBase
    from kv_transfer.write_back import WriteBackResult, WriteBackTicket
    from prefill_workers.worker import PrefillResult, PrefillWorker

MAX_STREAMS = 64
# A write-back's calls to its target: they wait for one engine step at most (the lock is fair),
# so this only bounds a frozen target.
WRITE_BACK_CALL_S = 30.0
log = logging.getLogger(__name__)
HEALTH, CONTROL, FEED = "health", "control", "feed"
CONCURRENCY_GROUPS = {HEALTH: 4, CONTROL: 16, FEED: 8}

_F = TypeVar("_F", bound=Callable[..., Any])
_W = TypeVar("_W", bound="WorkerBase")


def _decode() -> type[DecodeWorker]:
    from decode_workers.worker import DecodeWorker

    return DecodeWorker


def _prefill() -> type[PrefillWorker]:
    from prefill_workers.worker import PrefillWorker

    return PrefillWorker


def _lane(group: str) -> Callable[[_F], _F]:
    """`ray.method(concurrency_group=group)`, typed as what it is for a local call: the method itself."""

    def tag(fn: _F) -> _F:
        return cast(_F, ray.method(concurrency_group=group)(fn))

    return tag


class _Hosted:
    """An actor around one worker, `self.w`: its calls on their lanes. The request-serving
    calls stay in the default group, counted by `serving()` for idle()."""

    w: WorkerBase
    pushers: Pushers  # the sockets its outputs go down to routers (cluster/feed_channel.py)
    _flip_to = ""  # drained to turn into this role (PDActor.flip): a restarted manager reads it in stats()

    @property
    def worker_id(self) -> str:
        return self.w.worker_id

    @property
    def role(self) -> str:
        return self.w.role

    @_lane(HEALTH)
    def ping(self) -> str:
        return self.w.ping()

    @_lane(HEALTH)
    def drain(self, flip_to: str = "") -> None:
        """Take no new work; `flip_to`: the role it is drained to turn into (kept for stats())."""
        self._flip_to = flip_to
        self.w.drain()

    @_lane(CONTROL)
    def renew(self, request_id: str, lease_s: float) -> bool:
        """A router still watching the request's prefill extends its reservation (cluster.handoff)."""
        w = self.w
        return w.renew(request_id, lease_s) if isinstance(w, _decode()) else False

    @_lane(CONTROL)
    def idle(self) -> bool:
        return self.w.idle()

    @_lane(CONTROL)
    def abort(self, request_id: str) -> bool:
        return self.w.abort(request_id)

    @_lane(CONTROL)
    def stats(self) -> dict[str, Any]:
        return {**self.w.stats(), "flip_to": self._flip_to}

    @_lane(FEED)
    def take_outputs(self, subscriber: str, wait_s: float) -> list[Item]:
        return self.w.take_outputs(subscriber, wait_s)

    @_lane(FEED)
    def attach_feed(self, subscriber: str, address: tuple[str, int], token: bytes, wait_s: float) -> None:
        """Push `subscriber`'s outputs to its router down a socket (cluster/feed_channel.py)."""
        outboxes = self.w.outboxes
        self.pushers.attach(outboxes.take, outboxes.give_back, outboxes.lost, subscriber, address, token, wait_s)

    def _share_cores(self, namespace: str) -> None:
        if self.w.config.lend_cores:
            from engine.core_ledger import ledger_path

            self.w.share_cores(ledger_path(namespace))

    def start(self, *args: Any, **kwargs: Any) -> None:
        with self.w.serving():
            self.w.start(*args, **kwargs)

    @_lane(CONTROL)
    def check_integrity(self) -> None:
        self.w.check_integrity()

    def pop_block_events(self) -> tuple[list[int], list[int]]:
        return self.w.pop_block_events()

    def shutdown(self) -> None:
        self.w.shutdown()


class PDActor(_Hosted, PublishesBlocks):
    """A prefill or a decode worker that can flip to the other role in place (`flip`): the
    engine, its weights and its cache (prefix cache included) stay; only the role's parts (the
    KV server, or the KV clients) close and open anew. A call for the role it no longer has is
    refused as a draining worker refuses one (WorkerDraining: the router tries another)."""

    w: PrefillWorker | DecodeWorker

    def __init__(
        self,
        worker_id: str,
        model_path: str,
        config: EngineConfig,
        state_url: str,
        namespace: str,
        transport: str = "grpc",
        tls: KVTLSConfig | None = None,
    ) -> None:
        self._model_path, self._transport, self._tls = model_path, transport, tls
        self.w = self._make(worker_id, config, None)
        self.pushers = Pushers()
        # a request's end publishes its answer's blocks at once: a next turn may follow right away
        self.w.loop.on_outputs.append(self._publish_on_finish)
        self._share_cores(namespace)
        self._register(state_url, namespace)

    def _make(self, worker_id: str, config: EngineConfig, core: WorkerBase | None) -> PrefillWorker | DecodeWorker:
        if config.role == "prefill":
            return _prefill()(
                worker_id, self._model_path, config, self._transport, tls=self._tls, host=bind_host(), core=core
            )
        in_place = self._transport in ("shm", "auto")  # the cache in /dev/shm, for prefill workers to write
        return _decode()(
            worker_id, self._model_path, config, host=bind_host(), tls=self._tls, core=core, in_place=in_place
        )

    @_lane(CONTROL)
    def flip(self, config: EngineConfig) -> float:
        """Serve `config.role` from now on (engine/role_switch.py: same weights, same cache);
        returns the seconds it took. The worker must be drained and idle, and it is open for
        work again after. Raises WorkerDraining if it is not drained, ValueError if it is not
        idle or `config` needs another engine."""
        t = time.monotonic()
        old, self._flip_to = self.w, ""  # done or refused, the intent is spent
        if config.role == old.role:
            old.draining = False
            return 0.0
        if not old.draining:
            raise WorkerDraining(f"worker {old.worker_id} must be drained before it flips")
        if not self.idle():
            raise ValueError(f"worker {old.worker_id} still has work in flight")
        from engine.role_switch import check_switch

        old.loop.call(lambda e: check_switch(e, config))  # before anything closes: a refusal changes nothing
        old.close_role()
        self.w = self._make(old.worker_id, config, old)
        self._reregister()
        return time.monotonic() - t

    def _as(self, kind: type[_W]) -> _W:
        if not isinstance(self.w, kind):
            raise WorkerDraining(f"worker {self.w.worker_id} serves {self.w.role} now")
        return self.w

    def _publish_on_finish(self, outs: list[RequestOutput]) -> None:
        if any(o.finished for o in outs):
            self.publish_soon()

    # ---- prefill ----------------------------------------------------------------------------

    def prefill(self, *args: Any, **kwargs: Any) -> PrefillResult:
        w = self._as(_prefill())
        with w.serving():
            try:
                return w.prefill(*args, **kwargs)
            finally:
                self.publish_soon()

    def reserve_write_back(self, request_id: str, keys: list[int]) -> WriteBackTicket | None:
        return self._as(_prefill()).reserve_write_back(request_id, keys)

    def adopt_write_back(self, request_id: str, keys: list[int]) -> None:
        try:
            self._as(_prefill()).adopt_write_back(request_id, keys)
        finally:
            self.publish_soon()  # the next turn, perhaps sent already, looks these blocks up

    # ---- decode -----------------------------------------------------------------------------

    def reserve(self, request_id: str, num_tokens: int, lease_s: float | None = None, owner: str = "") -> bytes:
        return self._as(_decode()).reserve(request_id, num_tokens, lease_s, owner)

    def start_decode(self, *args: Any, **kwargs: Any) -> None:
        w = self._as(_decode())
        with w.serving():
            w.start_decode(*args, **kwargs)

    def write_back(self, request_id: str, keys: list[int], target: Any) -> WriteBackResult | None:
        """DecodeWorker.send_write_back to `target`, a prefill actor. Best effort, after a turn: a
        failure is logged, never raised (the next turn then prefills the answer again)."""

        def reserve(sent: list[int]) -> WriteBackTicket | None:
            ticket: WriteBackTicket | None = ray.get(
                target.reserve_write_back.remote(request_id, sent), timeout=WRITE_BACK_CALL_S
            )
            return ticket

        def adopt(sent: list[int]) -> None:
            ray.get(target.adopt_write_back.remote(request_id, sent), timeout=WRITE_BACK_CALL_S)

        try:
            w = self._as(_decode())
            with w.serving():
                return w.send_write_back(request_id, keys, reserve, adopt)
        except Exception as e:
            log.warning("write-back %s failed: %s: %s", request_id, type(e).__name__, e)
            return None

    @_lane(CONTROL)
    def release(self, request_id: str) -> bool:
        w = self.w
        return w.release(request_id) if isinstance(w, _decode()) else False

    @_lane(CONTROL)
    def idle(self) -> bool:
        w = self.w
        if isinstance(w, _decode()):  # a reservation is a request between reserve() and generate()
            rx = w.receiver
            if not w.loop.call(lambda e: len(rx.table) == 0 and not rx.fence.ids()):
                return False
        return w.idle()


class ColocatedActor(_Hosted, Registered):
    w: ColocatedWorker

    def __init__(self, worker_id: str, model_path: str, config: EngineConfig, state_url: str, namespace: str) -> None:
        from decode_workers.colocated import ColocatedWorker

        self.w = ColocatedWorker(worker_id, model_path, config)
        self.pushers = Pushers()
        self._share_cores(namespace)
        self._register(state_url, namespace)

    def generate(self, *args: Any, **kwargs: Any) -> Iterator[TokenOutput]:
        with self.w.serving():
            yield from self.w.generate(*args, **kwargs)
