"""What the routers' autoscalers share in Redis: which one decides, and the others' windows.

    tandem:{ns}:autoscale:leader    string  the deciding router's id; PEXPIRE = its lease
    tandem:{ns}:autoscale:windows   list    JSON windows of the routers standing by, oldest first;
                                            EXPIRE = a few intervals (no leader reads them)
    tandem:{ns}:autoscale:changed   string  JSON of the last change of sizes (LastChange: wall-clock
                                            seconds, the pool a worker flipped to, the router), so
                                            that a router that takes the lead over keeps the
                                            cooldown and the flip-back hysteresis

router/window_share.py says what goes in them and why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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


@dataclass(frozen=True)
class LastChange:
    """The autoscaler's last change of sizes."""

    at_s: float  # wall-clock seconds in the store; a WindowShare gives them on its reader's monotonic clock
    flipped_to: str | None = None  # the pool a worker flipped to with it (planner.autoscale.Memory)
    by: str = ""  # the id of the router that decided it


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
    def set_last_change(self, change: LastChange) -> None:
        payload = {"at_s": change.at_s, "flipped_to": change.flipped_to, "by": change.by}
        self._r.set(self.key("autoscale", "changed"), json.dumps(payload))

    @unavailable_as_state_error
    def last_change(self) -> LastChange | None:
        """The autoscaler's last change of sizes, by any router (wall clock); None if none. A bare
        number (what routers before the flip was kept wrote) is a change with no flip, by nobody known."""
        got = self._r.get(self.key("autoscale", "changed"))
        if got is None:
            return None
        d = json.loads(got)
        if isinstance(d, int | float):
            return LastChange(float(d))
        return LastChange(float(d["at_s"]), d.get("flipped_to"), str(d.get("by", "")))
