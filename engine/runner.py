"""Turns a SchedulerOutput into model inputs, runs the model and samples.

The only torch-facing part of a step; one host sync (the sampler's .tolist()), and one for each
slice of prompt rows scored where a request asks for prompt logprobs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.attention import AttentionMetadata, PrefillChunk
from engine.cuda_graphs import GraphedDecode
from engine.grammar import allowed_tokens
from engine.graph_buckets import DecodeBatch
from engine.kv_cache import KVCacheManager
from engine.model import LayerCallback, LlamaModel
from engine.paged_cache import PagedKVCache
from engine.penalties import SeenTokens
from engine.prompt_logprobs import PromptRows, score
from engine.request import Request
from engine.sampler import Sampler, SamplerOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk, SchedulerOutput


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: PagedKVCache, kv: KVCacheManager) -> None:
        self.model = model
        self.cache = cache
        self.kv = kv
        self.graphs: GraphedDecode | None = None  # decode-only steps replayed on CUDA (Engine sets it)
        # the step's one host sync: logits -> token ids (a test on the meta device, where no
        # value can be read, puts its own here)
        self.sampler: Callable[
            [torch.Tensor, Sequence[SamplingParams], Sequence[int], Sequence[SeenTokens | None], torch.Tensor | None],
            SamplerOutput,
        ] = Sampler()
        self.block_size = cache.block_size
        self.eos_ids: frozenset[int] = frozenset()  # what `min_tokens` holds back, with the request's stop tokens

    def execute(self, out: SchedulerOutput, on_layer_done: LayerCallback | None = None) -> SamplerOutput:
        """Run one step; returns one sample per completing chunk, in `out.chunks` order (a chunk
        with a draft of k tokens: k + 1 samples, one a position)."""
        logits, completing, scored = self.forward(out, on_layer_done)
        if scored:  # the prompt rows' logits follow the rows to sample
            sampling = sum(len(c.draft) + 1 for c in completing)
            score(logits[sampling:], scored)
            logits = logits[:sampling]
        rows = [(c, i) for c in completing for i in range(len(c.draft) + 1)]  # position i of c's draft
        params = [c.request.params for c, _ in rows]
        # a drafted position i samples with output index n + i: the draw it would get unspeculated
        index = [c.request.num_output_tokens + c.request.params.output_offset + i for c, i in rows]
        # and what it has seen: its tokens and the draft before it, which it needs accepted
        seen = [self._seen(c.request, c.draft[:i], at) if c.request.params.penalized else None
                for (c, i), at in zip(rows, index, strict=True)]  # fmt: skip
        matchers = [c.request.grammar for c, _ in rows]  # structured output: a guided row's mask
        allowed = None
        if any(m is not None for m in matchers):
            allowed = allowed_tokens(matchers, logits.shape[1], logits.device, [c.draft[:i] for c, i in rows])
        return self.sampler(logits, params, index, seen, allowed)

    def _seen(self, req: Request, draft: Sequence[int], answer_len: int) -> SeenTokens:
        """What a row of `req` that samples answer token `answer_len` (after `draft`) has seen."""
        p = req.params
        banned: tuple[int, ...] = ()
        if answer_len < p.min_tokens:
            banned = tuple(sorted({*p.stop_token_ids, *(() if p.ignore_eos else self.eos_ids)}))
        return SeenTokens([*req.token_ids, *draft], req.decode_from, banned)

    def forward(
        self, out: SchedulerOutput, on_layer_done: LayerCallback | None = None
    ) -> tuple[torch.Tensor, list[ScheduledChunk], list[PromptRows]]:
        """The step's model inputs, built on the cache's device, through the model: logits
        [rows to sample + prompt rows to score, vocab], the chunks the first belong to and the
        prompt rows of the rest (engine/prompt_logprobs.py). No host sync."""
        bs = self.block_size
        dev = self.cache.device
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        completing: list[ScheduledChunk] = []
        scored: list[PromptRows] = []
        prompt_rows: list[int] = []  # the rows of `scored`, in order
        # a decode runs one row; a decode with a draft of k tokens k + 1 rows, each attending to
        # its own position's context (the draft's KV is written before attention reads it)
        tables: list[list[int]] = []
        lens: list[int] = []
        for c in out.decodes:
            table = self.kv.block_table(c.request.request_id)
            self._score(c, len(ids), scored, prompt_rows)
            for i, tok in enumerate(c.token_ids):
                p = c.start + i
                ids.append(tok)
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
                tables.append(table)
                lens.append(p + 1)
            if c.completes:
                logits_rows.extend(range(len(ids) - 1 - len(c.draft), len(ids)))
                completing.append(c)
        decode_only = bool(ids) and not out.prefills and on_layer_done is None and len(logits_rows) == len(ids)
        if self.graphs is not None and decode_only and not scored:
            used = [t[: -(-n // bs)] for t, n in zip(tables, lens, strict=True)]
            graphed = self.graphs.logits(DecodeBatch(ids, pos, slots, used, lens))
            if graphed is not None:
                return graphed, completing, scored
        decode_tables = decode_mask = decode_lens = None
        if tables:
            max_blocks = max((n + bs - 1) // bs for n in lens)
            padded = [t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks])) for t in tables]
            decode_tables = torch.tensor(padded, device=dev)
            decode_lens = torch.tensor(lens, device=dev)
            decode_mask = (torch.arange(max_blocks * bs, device=dev).unsqueeze(0) < decode_lens.unsqueeze(1)).view(
                len(tables), 1, 1, -1
            )  # [rows, 1, 1, L]
        prefills: list[PrefillChunk] = []
        for c in out.prefills:
            table = self.kv.block_table(c.request.request_id)
            start = len(ids)
            self._score(c, start, scored, prompt_rows)
            ids.extend(c.request.token_ids[c.start : c.end])
            pos.extend(range(c.start, c.end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(c.start, c.end))
            needed = (c.end + bs - 1) // bs
            prefills.append(PrefillChunk(start, len(ids), c.start, torch.tensor(table[:needed], device=dev)))
            if c.completes:
                logits_rows.append(len(ids) - 1)
                completing.append(c)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev),
            num_decodes=len(tables),
            decode_block_tables=decode_tables,
            decode_mask=decode_mask,
            prefills=tuple(prefills),
            decode_max_len=max(lens, default=0),
            decode_seq_lens=decode_lens,
        )
        logits = self.model.forward(
            torch.tensor(ids, device=dev),
            torch.tensor(pos, device=dev),
            self.cache,
            meta,
            torch.tensor(logits_rows + prompt_rows, dtype=torch.long, device=dev),
            on_layer_done,
        )
        return logits, completing, scored

    @staticmethod
    def _score(c: ScheduledChunk, first_row: int, scored: list[PromptRows], prompt_rows: list[int]) -> None:
        """Add the rows of chunk `c` (its first at `first_row`) that score prompt tokens, if any."""
        rows = PromptRows.of(c.request, c.start, c.num_new_tokens - len(c.draft))
        if rows is not None:
            scored.append(rows)
            prompt_rows.extend(range(first_row, first_row + rows.end - rows.start))
