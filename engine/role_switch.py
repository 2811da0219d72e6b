"""A role flip's engine half: the same weights and KV cache (prefix cache included) serve
another role, with that role's batching limits and speculation. Nothing reloads.

Only an idle engine switches (no request, hand-off or reservation holds a block), and only to a
config that differs in what can change in place; anything else needs a new engine."""

from __future__ import annotations

from dataclasses import fields, replace

from engine.config import EngineConfig
from engine.engine import Engine
from engine.speculation import speculator_for

# What switching in place can change; any other field differing needs another engine.
IN_PLACE_FIELDS = frozenset(
    {"role", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk", "speculative", "num_speculative_tokens"}
)


def check_switch(engine: Engine, config: EngineConfig) -> None:
    """Raise ValueError if `engine` holds any request or `config` needs a reload."""
    config = _sized(engine, config)
    if engine.has_unfinished() or engine.kv.num_requests:
        raise ValueError(f"the engine holds {engine.kv.num_requests} requests' blocks: drain it first")
    reload = [f.name for f in fields(EngineConfig) if f.name not in IN_PLACE_FIELDS
              and getattr(config, f.name) != getattr(engine.config, f.name)]  # fmt: skip
    if reload:
        raise ValueError(f"{', '.join(reload)} differ: a role flip keeps the engine, these need a new one")


def switch_role(engine: Engine, config: EngineConfig) -> None:
    """Make `engine` serve as `config` says. Call it on the engine's loop (the lock held).
    Raises ValueError as `check_switch`."""
    check_switch(engine, config)
    engine.config = _sized(engine, config)
    engine.scheduler.max_num_seqs = config.max_num_seqs
    engine.scheduler.max_num_batched_tokens = config.max_num_batched_tokens
    engine.scheduler.prefill_chunk = config.prefill_chunk
    engine.speculator = speculator_for(config, engine.kv, engine.max_model_len)


def _sized(engine: Engine, config: EngineConfig) -> EngineConfig:
    """`config`, where it leaves the cache's size to memory (num_blocks None, as `tandem serve`
    does), with the engine's: the cache it sized when it started is the one that stays."""
    return config if config.num_blocks is not None else replace(config, num_blocks=engine.kv.num_blocks)
