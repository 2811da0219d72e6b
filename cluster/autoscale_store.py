"""What the routers' autoscalers share in Redis: which one decides, and the others' windows.

    tandem:{ns}:autoscale:leader    string  the deciding router's id; PEXPIRE = its lease
    tandem:{ns}:autoscale:windows   list    JSON windows of the routers standing by, oldest first;
                                            EXPIRE = a few intervals (no leader reads them)
    tandem:{ns}:autoscale:changed   string  wall-clock seconds of the last change of sizes, so that
                                            a router that takes the lead over keeps the cooldown

router/window_share.py says what goes in them and why.
"""

from __future__ import annotations

from typing import cast

from cluster.state_store import StateStore, unavailable_as_state_error

# KEYS[1] = leader key; ARGV = owner, lease_ms -> 1 if `owner` holds the lease (renewed), else 0.
_LEAD_LUA = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
if holder then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""


class AutoscaleStore(StateStore):
    """ClusterState's part that the autoscalers of several routers share."""

    @unavailable_as_state_error
    def lead(self, owner: str, lease_s: float) -> bool:
        """Take or renew the autoscaler's lease for `owner`; False while another holds it."""
        script = self._r.register_script(_LEAD_LUA)
        return bool(script(keys=[self.key("autoscale", "leader")], args=[owner, max(1, int(lease_s * 1000))]))

    @unavailable_as_state_error
    def push_window(self, payload: str, ttl_s: float) -> None:
        key = self.key("autoscale", "windows")
        pipe = self._r.pipeline(transaction=True)
        pipe.rpush(key, payload)
        pipe.expire(key, max(1, int(ttl_s)))
        pipe.execute()

    @unavailable_as_state_error
    def pop_windows(self) -> list[str]:
        """Every window pushed since the last pop, oldest first; the list is emptied."""
        key = self.key("autoscale", "windows")
        pipe = self._r.pipeline(transaction=True)
        pipe.lrange(key, 0, -1)
        pipe.delete(key)
        got, _ = pipe.execute()
        return cast("list[str]", got)

    @unavailable_as_state_error
    def set_last_change(self, wall_s: float) -> None:
        self._r.set(self.key("autoscale", "changed"), repr(wall_s))

    @unavailable_as_state_error
    def last_change(self) -> float | None:
        """Wall-clock seconds of the autoscaler's last change of sizes, by any router; None if none."""
        got = self._r.get(self.key("autoscale", "changed"))
        return None if got is None else float(got)
