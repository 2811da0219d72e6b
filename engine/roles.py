"""One vocabulary for roles, from the engine to the admin API.

A worker, its engine and the pool it serves in share one role:

    prefill     prompts: a request stops after its first token; its KV goes to a decode worker
    decode      answers to prompts a prefill worker computed (and whole requests on the local route)
    colocated   whole requests, prompt and answer, on one worker

Prefill and decode workers flip between the two in place (FLIPPABLE).
"""

from __future__ import annotations

from typing import Literal

Role = Literal["prefill", "decode", "colocated"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "colocated")
FLIPPABLE: tuple[Role, ...] = ("prefill", "decode")
