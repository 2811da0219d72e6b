"""Offline generation: prompts run to their ends on an engine that no serving loop drives."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.outputs import Completion
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.engine import Engine


def generate(
    engine: Engine, ids: Sequence[str], prompts: Sequence[str | Sequence[int]], params: SamplingParams
) -> list[Completion]:
    """Add each prompt under its id and step `engine` until nothing is left; results in prompt
    order (finish_reason "error" where the engine failed on one: engine/containment.py).

    Other requests already in the engine keep running, but their outputs are dropped."""
    results = {i: Completion(i, [], [], "", None) for i in ids}
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
        results[rid].prompt_token_ids = list(engine.scheduler.requests[rid].prompt_token_ids)
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id not in results:
                continue
            r = results[o.request_id]
            r.token_ids += o.new_token_ids
            r.text += o.new_text
            r.logprobs += o.logprobs
            r.prompt_logprobs = r.prompt_logprobs or o.prompt_logprobs
            r.finish_reason = o.finish_reason
            r.num_cached_tokens = max(r.num_cached_tokens, o.num_cached_tokens)
    return [results[i] for i in ids]
