"""Frozen configuration of the model and of the engine that runs it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.roles import ROLES, Role

if TYPE_CHECKING:  # torch is imported where a tensor is made: the pool manager reads configs, and starts
    import torch  # faster without it (cluster/actors.py)

CPU_PREFILL_CHUNK = 512  # EngineConfig.prefill_chunk
# "int8": weights quantized per channel, activations in fp32 (and the KV cache, unless kv_dtype says otherwise).
# "int4": the layers' weights in 4 bits (a GGUF's own Q4_1 blocks), the LM head int8, activations in fp32.
# The kernels a prefill chunk's attention can run on the CPU (engine/prefill_kernels.py picks):
# "int8" (engine/csrc/prefill_attention_i8.c, AVX512-VNNI), "float" (prefill_attention.c: bf16
# dot products with AVX512-BF16, fp32 with AVX2), "torch" (its SDPA, fp32), "auto" (see there).
PREFILL_ATTENTION = ("auto", "int8", "float", "torch")

# each dtype's activations (and KV cache, unless kv_dtype says otherwise), as torch names them
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "int8": "float32", "int4": "float32"}
KV_DTYPES = ("auto", "fp32", "bf16", "fp16", "int8", "fp8")  # engine/kv_codec.py


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family checkpoint, resolved from GGUF metadata or config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: dtype, cache size, batching limits and role.

    role (engine/roles.py) "colocated" runs whole requests; "prefill" stops each request after its first token
    and hands over its KV blocks; "decode" admits requests whose KV was written from outside.
    """

    dtype: str = "auto"
    block_size: int = 16
    num_blocks: int | None = 2048  # None: sized from the memory where the engine runs (engine/kv_budget.py)
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # Tokens of one prompt a step at most, so that a long prompt leaves room in every step for
    # the short ones behind it (None: CPU_PREFILL_CHUNK on the CPU, the whole budget elsewhere;
    # 0: the whole budget). See `prefill_chunk`.
    max_prefill_chunk: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    role: Role = "colocated"
    num_threads: int | None = None
    # Workers of one host that split its cores (num_threads) lend them to each other while idle
    # (engine/core_ledger.py); off: each steps on num_threads, busy peers or not.
    lend_cores: bool = True
    speculative: str = ""  # "ngram" / "suffix": drafts verified each step (engine/speculation.py)
    num_speculative_tokens: int = 8
    kv_dtype: str = "auto"  # how the KV cache stores keys and values: engine/kv_codec.py
    prefill_attention: str = "auto"  # a prefill chunk's attention kernel on the CPU: PREFILL_ATTENTION
    weight_cache: bool = True  # prepared weights cached beside the checkpoint (engine/weight_cache.py)
    device: str = "cpu"  # cpu, cuda[:N], auto (cuda where torch sees one) or meta (shapes only: tests)
    cuda_graphs: bool = True  # on CUDA, decode-only steps replay captured graphs (engine/cuda_graphs.py)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1 or (self.num_blocks is not None and self.num_blocks < 1):
            raise ValueError("block_size and num_blocks must be >= 1")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 0:
            raise ValueError(f"max_prefill_chunk must be >= 0 (0: the whole budget), got {self.max_prefill_chunk}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(
                f"prefill_attention must be one of {', '.join(PREFILL_ATTENTION)}, got {self.prefill_attention!r}"
            )
        if self.device not in ("cpu", "auto", "meta") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be cpu, cuda[:N], auto or meta, got {self.device!r}")
        if self.speculative not in ("", "ngram", "suffix") or self.num_speculative_tokens < 1:
            raise ValueError(f"speculative must be '', 'ngram' or 'suffix', num_speculative_tokens >= 1, got "
                             f"{self.speculative!r}, {self.num_speculative_tokens}")  # fmt: skip

    @property
    def torch_device(self) -> torch.device:
        """The device every engine tensor lives on, `auto` resolved."""
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def prefill_chunk(self) -> int:
        """Tokens of one prompt a step at most, resolved (the budget when not capped).

        Measured on the CPU (`tandem bench hol`, SmolLM2 int8, 1 thread): a 64-token prompt that
        arrives with a 2K, 4K or 8K one waited for all of it, 4.4 / 12.2 / 37.7 s; capped at 512
        it waits about one chunk, 0.8 s, and the long prompt alone takes as long as before.
        Not measured on a GPU, where per-step cost weighs more: off there by default."""
        if self.max_prefill_chunk is None:
            cap = CPU_PREFILL_CHUNK if self.torch_device.type == "cpu" else 0
        else:
            cap = self.max_prefill_chunk
        return min(cap, self.max_num_batched_tokens) if cap else self.max_num_batched_tokens

    @property
    def num_gpus(self) -> int:
        """GPUs a worker running this config claims from Ray: 1 for cuda, else 0 (`auto` is
        resolved where the worker runs, so it claims none: name `cuda` to be placed on one)."""
        return 1 if self.device.startswith("cuda") else 0

    @property
    def weight_dtype(self) -> str:
        """The dtype, `auto` resolved for this CPU: bf16 where it has AMX, int4 on AVX2 without
        AVX512-VNNI, else int8 (fp32, or bf16 on AVX512-BF16, where torch lacks int8 kernels); see
        engine.linear.auto_dtype. Off the
        CPU, `auto`, `int8` and `int4` are bf16: their kernels are CPU-only."""
        if self.torch_device.type != "cpu" and self.dtype in ("auto", "int8", "int4"):
            return "bf16"
        if self.dtype != "auto":
            return self.dtype
        from engine.linear import auto_dtype, cpu_flags, has_int8_kernels

        return auto_dtype(cpu_flags(), has_int8_kernels())

    @property
    def torch_dtype(self) -> torch.dtype:
        """dtype of activations and of the KV cache."""
        import torch

        dtype: torch.dtype = getattr(torch, DTYPES[self.weight_dtype])
        return dtype

    @property
    def kv_storage(self) -> str:
        """kv_dtype, `auto` resolved as an engine of these weights resolves it (engine/kv_codec.py):
        for the startup line."""
        from engine.kv_codec import KVCodec

        return KVCodec.of(self.kv_dtype, self.torch_dtype, self.weight_dtype in ("int8", "int4")).kind
