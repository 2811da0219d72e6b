"""What the prefix cache hashes each position of a request as: its token id, flagged where a
decode row computed its KV.

The int8 attention kernels round a decode row's KV otherwise than a prefill row's for the same
tokens (README, "A chat's earlier answers run as the decode rows that wrote them"). So a block's
hash says which way each of its positions was computed, and a prompt finds only blocks computed
the way it runs them itself: a turn answers alike with its history cached or not, whether its
earlier answers came marked (a chat through the router: `SamplingParams.decoded`) or not (a
completions prompt carrying a conversation, or `Cluster.generate` with no spans, which then
prefill those answers again rather than reuse KV their run would not have computed). A request
with a `cache_salt` hashes apart from every other salt's and from none (`_salt`).
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from engine.sampling_params import SamplingParams

DECODE_ROW = 1 << 30  # above any vocabulary's ids; a key still packs as an int32
# positions a `cache_salt` reaches: the whole first block (up to this size), and through the chained
# hash every block after it
SALTED = 64


def decode_from(num_prompt_tokens: int, params: SamplingParams) -> int:
    """The first position a decode row computes: the prompt's end, less the outputs of earlier
    runs it carries (`SamplingParams.output_offset`). Every position after it runs so too."""
    return max(0, num_prompt_tokens - params.output_offset)


def cache_keys(token_ids: Sequence[int], num_prompt_tokens: int, params: SamplingParams) -> list[int]:
    """`token_ids` (a prompt of `num_prompt_tokens`, then what was decoded after it) as the prefix
    cache hashes them: flagged from `decode_from` on and within `params.decoded` (also where
    `decoded_as_prompt` prefills those spans: they hash as what a decode wrote there, so a warm
    turn still finds the answer's KV)."""
    start = decode_from(num_prompt_tokens, params)
    keys = list(token_ids)
    for i in range(start, len(keys)):
        keys[i] |= DECODE_ROW
    for a, b in params.decoded:
        for i in range(a, min(b, start, len(keys))):
            keys[i] |= DECODE_ROW
    if params.cache_salt is not None:
        _salt(keys, params.cache_salt)
    return keys


def _salt(keys: list[int], salt: str) -> None:
    """vLLM's cache_salt: each of the first SALTED keys becomes a negative int32 drawn from (salt,
    position, key), so a block of them hashes apart from any unsalted block (keys >= 0) and from
    another salt's: a tenant's prompts are found in the prefix cache (and its timing, and the
    index's routing) only by requests with its salt."""
    seed = xxhash.xxh64_intdigest(salt.encode())
    for i in range(min(SALTED, len(keys))):
        keys[i] = -1 - xxhash.xxh64_intdigest(f"{i}:{keys[i]}".encode(), seed=seed) % (2**31 - 1)
