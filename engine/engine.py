"""Engine: add_request, step, abort — the only loop. Also the prefill/decode seam.

    step():  schedule -> run model + sample -> append tokens, detokenize, check stops

Roles (EngineConfig.role):
  colocated  whole requests.
  prefill  a request stops after its first token; its KV blocks stay held and are
           described by RequestOutput.kv until `release(request_id)`. One added `whole`
           runs to its end, as under `both`.
  decode   as `both`, plus requests whose prompt KV was written from outside:
           `reserve()` blocks, write them through `cache`, then `add_prefilled_request()`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.containment import Quarantine, failed_output
from engine.cuda_graphs import GraphedDecode
from engine.emitter import Emitter
from engine.errors import DuplicateRequestError, InvalidRequestError, PromptTooLongError
from engine.grammar import Grammars
from engine.kv_budget import cache_blocks
from engine.kv_cache import KVCacheManager
from engine.kv_codec import KVCodec
from engine.linear import auto_dtype_reason, cpu_flags, has_int8_kernels
from engine.model import LayerCallback, LlamaModel
from engine.offline import generate
from engine.outputs import Completion, KVHandoff, RequestOutput, TokenLogprob
from engine.paged_cache import PagedKVCache
from engine.prefill_kernels import pick_prefill_attention
from engine.request import Request, checked_prompt
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.speculation import speculator_for
from engine.tokenizer import Tokenizer
from engine.weight_cache import load_model

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: LlamaModel, tokenizer: Tokenizer | None, config: EngineConfig) -> None:
        if model.device != config.torch_device:
            raise ValueError(f"the model is on {model.device}, the engine's config says {config.torch_device}")
        self.model = model
        if model.device.type == "cpu":  # (engines that share a model share its kernel)
            model.prefill_attention = pick_prefill_attention(
                config.prefill_attention, model.native, model.quantized, model.config.head_dim
            )
        self.tokenizer = tokenizer
        self.max_model_len = min(config.max_model_len or model.config.max_position, model.config.max_position)
        codec = KVCodec.of(config.kv_dtype, model.dtype, model.quantized)
        num_blocks = cache_blocks(model, codec, config, self.max_model_len)  # the config's checked, or sized
        if config.num_threads:  # (once the config is known to fit: a refused engine changes nothing)
            torch.set_num_threads(config.num_threads)
        self.config = config = dataclasses.replace(config, num_blocks=num_blocks)  # None sized, as it ran
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        graphed = config.cuda_graphs and model.device.type == "cuda"
        # with graphs, one block more than the block manager hands out: padding rows write there
        blocks = num_blocks + (1 if graphed else 0)
        self.cache = PagedKVCache(model.config, blocks, config.block_size, model.dtype, codec, model.device)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, config.prefill_chunk)
        self.runner = ModelRunner(model, self.cache, self.kv)
        if graphed:
            widest = -(-self.max_model_len // config.block_size)
            self.runner.graphs = GraphedDecode(model, self.cache, widest, pad_block=num_blocks)
        self.speculator = speculator_for(config, self.kv, self.max_model_len)
        self.grammars = Grammars(tokenizer, model.config.vocab_size)  # structured output
        self.quarantine = Quarantine()  # the requests of a failed step, each run alone
        self._pending: list[RequestOutput] = []
        self._handoffs: set[str] = set()
        self._reserved: set[str] = set()
        self._arrivals = itertools.count()
        # Called once per step with the batch; the callback it returns (if any) runs after
        # each layer's KV is written. KV streaming hooks in here.
        self.layer_hook: Callable[[SchedulerOutput], LayerCallback | None] | None = None
        eos = tokenizer.stop_token_ids if tokenizer is not None else frozenset()
        self._eos_ids: frozenset[int] = frozenset(eos)
        self.runner.eos_ids = self._eos_ids
        self.emitter = Emitter(tokenizer, self._eos_ids, self.max_model_len)  # a token's effects on its request

    @classmethod
    def from_path(cls, path: str | Path, config: EngineConfig | None = None) -> Engine:
        """Load a GGUF file or HF directory with its tokenizer; an HF directory without
        tokenizer.json gets none (token ids only: the tiny test models)."""
        config = config or EngineConfig()
        device = config.torch_device
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device}: torch sees no GPU here (a CPU wheel, or no driver)")
        if device.type != "cpu":
            log.info("device %s: %s weights and activations (int8 kernels are CPU-only)", device, config.weight_dtype)
        elif config.dtype == "auto":
            why = auto_dtype_reason(cpu_flags(), has_int8_kernels())
            log.info("dtype auto -> %s (%s)", config.weight_dtype, why)
        model = load_model(path, config.torch_dtype, config.weight_dtype, config.weight_cache).to(device)
        p = Path(path)
        tokenizer = None if p.is_dir() and not (p / "tokenizer.json").exists() else Tokenizer.load(p)
        return cls(model, tokenizer, config)

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, whole: bool = False
    ) -> None:
        """Validate and queue a request; `whole`: run it to its end even on a prefill engine (the
        router spilled it there). Raises InvalidRequestError (or PromptTooLongError)."""
        req = self._new_request(request_id, prompt, params)
        req.hands_off = self.config.role == "prefill" and not whole
        self.scheduler.add(req)

    def prepare(self, params: SamplingParams) -> None:
        """What a request will need, made ahead, off the engine's lock (its grammar, compiled).
        Raises InvalidRequestError."""
        if isinstance(params, SamplingParams) and params.guide is not None:
            self.grammars.compiled(params.guide)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks (a prefill hand-off's too). False if
        the id is unknown. A reservation is not a request: its owner (kv_transfer/receiver.py,
        its lease and fence) frees it, or a late chunk could write freed blocks."""
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            self.scheduler.finish(req, "abort")
            self.emitter.close(request_id)
            return True
        return request_id in self._handoffs and self.release(request_id)

    def release(self, request_id: str) -> bool:
        """Free a prefill hand-off or a reservation that was never admitted."""
        if request_id in self._handoffs or request_id in self._reserved:
            self._handoffs.discard(request_id)
            self._reserved.discard(request_id)
            self.kv.free(request_id)
            return True
        return False

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    # ---- decode side of the P/D seam ------------------------------------------------------

    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        """Claim blocks for `num_tokens` tokens of KV to be written from outside.

        Raises NoFreeBlocksError, DuplicateRequestError, PromptTooLongError."""
        self._check_new_id(request_id)
        if num_tokens + 1 > self.max_model_len:
            raise PromptTooLongError(f"{num_tokens} tokens do not fit max_model_len {self.max_model_len}", "prompt")
        blocks = self.kv.reserve(request_id, num_tokens)
        self._reserved.add(request_id)
        return blocks

    def add_prefilled_request(
        self, request_id: str, prompt_token_ids: Sequence[int], first_token_id: int, params: SamplingParams
    ) -> None:
        """Admit a request whose prompt KV already sits in its reserved blocks.

        The first token (sampled by the prefill side) is emitted by the next step()."""
        if request_id not in self._reserved:
            raise InvalidRequestError(f"no reservation for request {request_id!r}", "request_id")
        reserved = len(self.kv.block_table(request_id)) * self.config.block_size
        if len(prompt_token_ids) > reserved:
            raise InvalidRequestError(f"{len(prompt_token_ids)} prompt tokens exceed the reservation", "prompt")
        self._reserved.discard(request_id)
        try:
            req = self._new_request(request_id, prompt_token_ids, params)
        except Exception:
            self.kv.free(request_id)
            raise
        req.num_computed_tokens = req.num_prompt_tokens
        self.scheduler.add(req)
        self._pending.append(self._append_token(req, first_token_id, None))

    # ---- write-back: a finished answer's KV copied into another engine's prefix cache ----------

    def hold_cached(self, holder_id: str, keys: Sequence[int]) -> list[int]:
        """The source side: `KVCacheManager.hold_cached`, until `release(holder_id)`."""
        self._check_new_id(holder_id)
        self._reserved.add(holder_id)
        return self.kv.hold_cached(holder_id, keys)

    def reserve_uncached(self, request_id: str, keys: Sequence[int]) -> tuple[int, list[int]]:
        """The target side: `KVCacheManager.reserve_uncached`, then `adopt` or `release`."""
        self._check_new_id(request_id)
        cached, blocks = self.kv.reserve_uncached(request_id, keys)
        self._reserved.add(request_id)
        return cached, blocks

    def adopt(self, request_id: str, keys: Sequence[int]) -> None:
        """Blocks of a `reserve_uncached`, now written: hashed into the prefix cache, then freed,
        where they stay cached until evicted. Raises InvalidRequestError."""
        if request_id not in self._reserved:
            raise InvalidRequestError(f"no reservation for request {request_id!r}", "request_id")
        self.kv.cache_full_blocks(request_id, keys, len(self.kv.block_table(request_id)) * self.config.block_size)
        self.release(request_id)

    # ---- the loop -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return every request with new tokens or a finish (finish_reason "error"
        where the step failed on it: engine/containment.py)."""
        results, self._pending = self._pending, []
        if self.speculator is not None:
            self.speculator.draft(self.scheduler.running)
        out = self.scheduler.schedule(self.quarantine.live(self.scheduler.requests.keys()))
        if not out.num_tokens:
            return results
        try:
            sampled = self.runner.execute(out, self.layer_hook(out) if self.layer_hook else None)
        except Exception as e:
            log.exception("a step of %d request(s) failed; those left run alone, one a step", len(out.chunks))
            return results + [self._fail(r, e) for r in self.quarantine.step_failed(out)]
        self.quarantine.step_passed(out)
        self.scheduler.advance(out)
        row = 0
        for c in out.chunks:
            if not c.completes:
                continue
            n = len(c.draft) + 1  # samples of this chunk
            toks, lps = sampled.token_ids[row : row + n], sampled.logprobs[row : row + n]
            row += n
            try:
                if c.draft and self.speculator is not None:
                    results.append(self.speculator.accept(c, toks, lps, self._append_token))
                else:
                    results.append(self._append_token(c.request, toks[0], lps[0]))
            except Exception as e:
                results.append(self._fail(c.request, e))
        return results

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams) -> list[Completion]:
        """Run prompts to completion offline: engine/offline.py."""
        return generate(self, [f"gen-{next(self._arrivals)}" for _ in prompts], prompts, params)

    def check_integrity(self) -> None:
        """Raise AssertionError if the scheduler, block tables and hand-offs disagree."""
        self.scheduler.check_integrity()
        holders = sum(self.kv.has_request(r) for r in self.scheduler.requests)
        expected = holders + len(self._handoffs) + len(self._reserved)
        assert self.kv.num_requests == expected, f"{self.kv.num_requests} block tables, {expected} owners"
        assert self.emitter.open_ids() <= set(self.scheduler.requests), "detokenizer state for a finished request"

    # ---- internals ------------------------------------------------------------------------

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.scheduler.requests or request_id in self._handoffs or request_id in self._reserved:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use", "request_id")

    def _new_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> Request:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be SamplingParams", "params")
        if request_id not in self._reserved:
            self._check_new_id(request_id)
        ids = checked_prompt(prompt, params, self.tokenizer, self.model.config.vocab_size, self.max_model_len,
                             self.config.block_size * self.kv.num_blocks)  # fmt: skip
        req = Request(request_id, ids, params, next(self._arrivals))
        if params.guide is not None:  # a replay's matcher has seen the tokens it carries
            req.grammar = self.grammars.matcher(params.guide)
            if not all(req.grammar.accept_token(t) for t in ids[len(ids) - params.output_offset :]):
                raise InvalidRequestError("the tokens carried do not follow the grammar", "response_format")
        self.emitter.open(req)
        return req

    def _fail(self, req: Request, e: Exception) -> RequestOutput:
        log.exception("the engine failed on request %s", req.request_id)
        self.abort(req.request_id)  # its blocks (a hand-off's too, if it got that far)
        return failed_output(req, e)

    def _append_token(self, req: Request, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        e = self.emitter.emit(req, token)
        handoff = None
        if e.reason == "prefill_done":  # its blocks stay held for the transfer
            handoff = KVHandoff(self.kv.block_table(req.request_id), req.num_prompt_tokens)
            self._handoffs.add(req.request_id)
        if e.reason is not None:
            self.scheduler.finish(req, e.reason, free_blocks=handoff is None)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[token],
            new_text=e.text,
            finished=e.reason is not None,
            finish_reason=e.reason,
            logprobs=[logprob] if logprob is not None else [],
            prompt_logprobs=e.prompt_logprobs,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            kv=handoff,
            queue_s=(req.first_scheduled_time or req.arrival_time) - req.arrival_time,
        )
