from __future__ import annotations

import functools
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from cluster.autoscale_store import LastChange
from cluster.redis_server import EmbeddedRedis
from cluster.state import ClusterState, StateUnavailable
from router.window import Sample, Taken
from router.window_share import RedisWindowShare
from tests.integration.waits import until


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as srv:
        yield srv


@pytest.fixture
def state(server: EmbeddedRedis) -> Iterator[ClusterState]:
    st = ClusterState(server.url, namespace=f"t{uuid.uuid4().hex[:8]}")
    yield st
    st.flush_namespace()
    st.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_server_is_local_and_password_protected(server: EmbeddedRedis) -> None:
    assert server.url == f"redis://:{server.password}@127.0.0.1:{server.port}/0"
    assert server.pid is not None and _alive(server.pid)
    assert server.data_dir is not None and (server.data_dir / "redis.conf").stat().st_mode & 0o777 == 0o600
    with socket.create_connection(("127.0.0.1", server.port), timeout=2) as anon:
        anon.sendall(b"PING\r\n")
        assert anon.recv(64).startswith(b"-NOAUTH")
    with redis.Redis.from_url(server.url) as client:
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        assert client.config_get("hz") == {"hz": "1"}  # no cron 10 times a second (TTLs expire on read)


def test_namespaces_are_isolated(server: EmbeddedRedis) -> None:
    a, b = ClusterState(server.url, "nsa"), ClusterState(server.url, "nsb")
    try:
        a.register_worker("w1", {"role": "prefill"}, ttl_s=30)
        a.set_desired("prefill", 2)
        a.add_blocks("w1", [1, 2])
        a.emit("worker_up", worker="w1")
        b.register_worker("w2", {"role": "decode"}, ttl_s=30)
        b.set_desired("decode", 3)
        assert list(a.workers()) == ["w1"] and list(b.workers()) == ["w2"]
        assert a.desired() == {"prefill": 2} and b.desired() == {"decode": 3}
        assert b.longest_prefix([1, 2], ["w1"]) == {"w1": 0}
        assert b.events() == []
        assert a.flush_namespace() == 6  # worker, workers, desired, blocks, block_workers, events
        assert a.workers() == {} and a.desired() == {} and a.events() == []
        assert list(b.workers()) == ["w2"] and b.desired() == {"decode": 3}
    finally:
        a.flush_namespace()
        b.flush_namespace()
        a.close()
        b.close()


@pytest.mark.parametrize("bad", ["", "a:b", "x*", "a b", "[a]"])
def test_namespace_validation(server: EmbeddedRedis, bad: str) -> None:
    with pytest.raises(ValueError, match="namespace"):
        ClusterState(server.url, bad)


def test_registry_info_roles_and_deregister(state: ClusterState) -> None:
    info = {"role": "prefill", "node": "n1", "endpoint": "127.0.0.1:5001", "gpu_class": "prefill", "load": 0}
    state.register_worker("p0", info, ttl_s=30)
    state.register_worker("d0", {"role": "decode", "node": "n1", "state": "ready"}, ttl_s=30)
    workers = state.workers()
    assert sorted(workers) == ["d0", "p0"]
    assert {k: v for k, v in workers["p0"].items() if k != "last_seen"} == info
    assert isinstance(workers["p0"]["last_seen"], float)
    assert list(state.workers(role="decode")) == ["d0"]
    assert state.heartbeat("d0", {"state": "draining", "load": 0.5}, ttl_s=30)
    assert state.workers("decode")["d0"]["state"] == "draining"
    assert state.workers("decode")["d0"]["load"] == 0.5
    assert state.workers("decode")["d0"]["node"] == "n1"
    state.register_worker("d0", {"role": "decode"}, ttl_s=30)
    assert "state" not in state.workers("decode")["d0"]
    state.deregister_worker("p0")
    state.deregister_worker("p0")
    assert list(state.workers()) == ["d0"]
    assert not state.heartbeat("p0")


def test_ttl_expiry_and_heartbeat(state: ClusterState) -> None:
    state.register_worker("short", {"role": "prefill"}, ttl_s=0.5)
    state.register_worker("kept", {"role": "decode"}, ttl_s=0.5)
    state.add_blocks("short", [7, 8])
    for _ in range(4):
        time.sleep(0.2)
        assert state.heartbeat("kept", ttl_s=0.5)
    assert list(state.workers()) == ["kept"]
    assert not state.heartbeat("short")
    assert state.longest_prefix([7, 8], ["short"]) == {"short": 0}  # pruned with the registry entry
    with pytest.raises(ValueError, match="ttl_s"):
        state.register_worker("x", {}, ttl_s=0)


def test_desired_sizes(state: ClusterState) -> None:
    assert state.desired() == {}
    state.set_desired("prefill", 2)
    state.set_desired("decode", 4)
    state.set_desired("colocated", 0)
    state.set_desired("decode", 3)
    assert state.desired() == {"prefill": 2, "decode": 3, "colocated": 0}
    for role, n in [("gpu", 1), ("", 1), ("prefill", -1), ("decode", 1.5), ("decode", True)]:
        with pytest.raises(ValueError):
            state.set_desired(role, n)  # type: ignore[arg-type]
    assert state.desired() == {"prefill": 2, "decode": 3, "colocated": 0}
    state.set_desired({"prefill": 1, "decode": 4})  # a rebalance: one write
    with pytest.raises(ValueError):
        state.set_desired({"prefill": 3, "decode": -1})  # nothing of a bad change is written
    assert state.desired() == {"prefill": 1, "decode": 4, "colocated": 0}


def test_longest_prefix(state: ClusterState) -> None:
    chain = [101, -5, 2**63 + 7, 404, 505]
    state.add_blocks("a", chain)
    state.add_blocks("b", chain[:2])
    state.add_blocks("c", [chain[0], chain[1], chain[3], chain[4]])  # hole at index 2
    state.add_blocks("d", chain[1:])  # misses the head
    names = ["a", "b", "c", "d", "nobody"]
    assert state.longest_prefix(chain, names) == {"a": 5, "b": 2, "c": 2, "d": 0, "nobody": 0}
    assert state.longest_prefix(chain[:1], names) == {"a": 1, "b": 1, "c": 1, "d": 0, "nobody": 0}
    assert state.longest_prefix([999, *chain], names) == dict.fromkeys(names, 0)
    assert state.longest_prefix([], ["a"]) == {"a": 0}
    assert state.longest_prefix(chain) == {}  # none of them is registered live
    for w in "abc":
        state.register_worker(w, {"role": "prefill"}, ttl_s=30)
    assert state.longest_prefix(chain) == {"a": 5, "b": 2, "c": 2}
    state.remove_blocks("a", [chain[2]])
    state.remove_blocks("a", [123456])
    assert state.longest_prefix(chain, ["a"]) == {"a": 2}
    state.add_blocks("a", [chain[2]])
    state.drop_worker_blocks("a")
    assert state.longest_prefix(chain) == {"b": 2, "c": 2}
    state.deregister_worker("b")
    assert state.longest_prefix(chain, ["a", "b", "c"]) == {"a": 0, "b": 0, "c": 2}


def test_one_router_holds_the_autoscalers_lease_and_reads_the_others_windows(state: ClusterState) -> None:
    a, b = RedisWindowShare(state, interval_s=0.1, owner="a"), RedisWindowShare(state, interval_s=0.1, owner="b")
    assert a.lead() and not b.lead() and a.lead()  # renewed by its holder, refused to the other
    b.publish(Taken(0.1, 2, (Sample(time.monotonic(), 9, 3, 0.5, 0.02),)))
    b.publish(Taken(0.1, 1, ()))
    got = a.collect()
    assert [t.requests for t in got] == [2, 1] and got[0].samples[0].prompt == 9
    assert abs(got[0].samples[0].arrival - time.monotonic()) < 5  # back on this process's clock
    assert a.collect() == []
    assert a.last_change() is None
    a.changed(time.monotonic() - 7.0, "decode")  # its last change of sizes: the next leader's cooldown counts
    assert a.last_change() is None  # from there, and it knows a worker flipped to decode; a's own is not news to a
    # its holder stops renewing (a router that died): the other takes over within a lease (0.3 s)
    until(b.lead, 2.0, "the lease passing to the other router")
    assert not a.lead()
    last = b.last_change()
    assert last is not None and abs(time.monotonic() - last.at_s - 7.0) < 1.0
    assert (last.flipped_to, last.by) == ("decode", "a")


def test_a_last_change_written_as_a_bare_number_reads_as_one_without_a_flip(
    state: ClusterState, server: EmbeddedRedis
) -> None:
    """What a router from before the flip was kept wrote, read by a newer one (a rolling upgrade)."""
    redis.Redis.from_url(server.url).set(state.key("autoscale", "changed"), repr(1733000000.5))
    last = state.last_change()
    assert last == LastChange(1733000000.5, None, "")
    assert RedisWindowShare(state, interval_s=0.1, owner="b").last_change() is not None


def test_events_order_and_paging(state: ClusterState) -> None:
    ids = [
        state.emit("worker_up", worker="p0", role="prefill"),
        state.emit("worker_draining", worker="p0"),
        state.emit("scaled", role="decode", replicas=3, workers=["d0", "d1"]),
        state.emit("worker_down", worker="p0", reason="drained"),
    ]
    events = state.events()
    assert [eid for eid, _ in events] == ids
    assert [e["kind"] for _, e in events] == ["worker_up", "worker_draining", "scaled", "worker_down"]
    assert events[0][1] == {"kind": "worker_up", "ts": events[0][1]["ts"], "worker": "p0", "role": "prefill"}
    assert events[2][1]["replicas"] == "3" and events[2][1]["workers"] == '["d0", "d1"]'
    assert abs(float(events[0][1]["ts"]) - time.time()) < 60
    assert state.events(since=ids[1]) == events[2:]
    assert state.events(since=ids[0], count=2) == events[1:3]
    assert state.events(since=ids[-1]) == []
    assert state.events(since="", count=2) == events[2:]  # the newest, oldest first


def test_survives_redis_restart() -> None:
    with EmbeddedRedis() as srv:
        st = ClusterState(srv.url, "restart")
        st.register_worker("p0", {"role": "prefill"}, ttl_s=30)
        st.set_desired("decode", 2)
        old_pid = srv.pid
        srv.restart()
        assert srv.pid != old_pid and old_pid is not None and not _alive(old_pid)
        assert st.ping()
        assert st.workers() == {} and st.desired() == {}  # no persistence: state is gone
        assert not st.heartbeat("p0")  # the worker learns it must re-register
        st.register_worker("p0", {"role": "prefill"}, ttl_s=30)
        st.add_blocks("p0", [1, 2, 3])
        assert st.heartbeat("p0", {"load": 1})
        assert st.longest_prefix([1, 2, 3]) == {"p0": 3}

        # A call made while Redis is down waits (retry with backoff) and succeeds once it is back.
        srv.stop()
        threading.Timer(0.3, srv.start).start()
        st.set_desired("prefill", 1)
        assert st.desired() == {"prefill": 1}
        st.close()


def test_stop_leaves_no_process() -> None:
    srv = EmbeddedRedis().start()
    pid, data_dir = srv.pid, srv.data_dir
    assert pid is not None and _alive(pid) and data_dir is not None
    st = ClusterState(srv.url, "gone", retries=1)
    srv.stop()
    srv.stop()
    assert srv.pid is None and not srv.running
    assert not _alive(pid) and not data_dir.exists()
    assert not st.ping()
    with pytest.raises(StateUnavailable):
        st.desired()
    st.close()


def test_watchdog_restarts_a_killed_server_on_the_same_port() -> None:
    with EmbeddedRedis() as srv:
        st = ClusterState(srv.url, "watchdog", socket_timeout_s=0.25, retries=0)
        st.set_desired("decode", 2)
        for n in (1, 2):
            old = srv.pid
            assert old is not None
            os.kill(old, signal.SIGKILL)
            until(functools.partial(_restarted, srv, n), 10, f"restart number {n}")
            assert not _alive(old) and srv.running and srv.pid != old and not srv.gave_up
            until(st.ping, 5, "the client to reconnect")
            assert st.desired() == {}  # no persistence: it came back empty
            st.set_desired("decode", 2)
        old = srv.pid
        srv.restart()  # on purpose: not a watchdog restart
        assert srv.pid != old and srv.restarts == 2
        st.close()
    assert not srv.running and old is not None and not _alive(old)


def _restarted(srv: EmbeddedRedis, n: int) -> bool:
    return srv.restarts == n  # counted once the new server answers PING


def test_watchdog_stops_after_its_restart_budget() -> None:
    srv = EmbeddedRedis(max_restarts=2, restart_backoff_s=0.3).start()
    pid = srv.pid
    assert pid is not None
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        os.kill(pid, signal.SIGKILL)
        until(lambda: _bound(squatter, srv.port), 5, "the port to be free")  # now every restart fails
        until(lambda: srv.gave_up, 30, "the watchdog to give up")
        assert srv.restarts == 0 and not srv.running
    finally:
        squatter.close()
        srv.stop()
    assert not srv.running


def _bound(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    sock.listen(1)
    return True


def test_stop_is_final_for_the_watchdog() -> None:
    srv = EmbeddedRedis(restart_backoff_s=0.01).start()
    pid = srv.pid
    srv.stop()  # joins the watchdog: nothing can start it again after this returns
    assert pid is not None and not _alive(pid) and not srv.running and srv.restarts == 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=1).close()
