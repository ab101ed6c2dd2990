"""Frozen configs built once at the edge: the model's shape and the engine's choices."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freetoken.errors import FreeTokenError
from freetoken.runtime.json_keys import (
    BOOL,
    COUNT,
    FRACTION,
    NON_NEGATIVE,
    NUMBER,
    POSITIVE,
    POSITIVE_INT,
    JsonObject,
    Kind,
)

ROPE_TYPES = ("default", "linear", "yarn")
DTYPES = ("float32", "bfloat16")
DTYPE_ALIASES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
MOE_BACKEND_NAMES = ("auto", "fused", "offload", "cpu", "hybrid")  # = moe.executor.BACKEND_CHOICES
CHECKPOINT_POLICIES = ("anchors", "interval", "none")
MAX_CPU_THREADS = 4096
MAX_PREFETCH = 128  # the LRU kernel's pairs per step
PREFETCH_WIDTH = Kind(f"an integer in [0, {MAX_PREFETCH}]", lambda v: COUNT.check(v) and v <= MAX_PREFETCH)
CPU_THREADS = Kind(
    f"an integer in [1, {MAX_CPU_THREADS}]", lambda v: POSITIVE_INT.check(v) and v <= MAX_CPU_THREADS
)


def flag_error(flag: str, problem: str) -> FreeTokenError:
    """A bad command-line value: one line that names the flag, exit code 2 as for the parser's own."""
    return FreeTokenError(f"{flag}: {problem}", exit_code=2)


def check_flags(*checks: tuple[str, Any, Kind]) -> None:
    """(flag, value, kind): a value that is given must be of its kind."""
    for flag, value, kind in checks:
        if value is not None and not kind.check(value):
            raise flag_error(flag, f"expected {kind.expected}, got {value}")


def check_choice(flag: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise flag_error(flag, f"expected one of {', '.join(choices)}, got {value!r}")
    return value


def check_device(name: str) -> str:
    """`--device`: auto, cpu, cuda or cuda:N (whether CUDA is there is found out when it is used)."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise flag_error("--device", f"expected auto, cpu, cuda or cuda:N, got {name!r}")
    return name


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, from `rope_parameters` or the older `rope_theta`/`rope_scaling`."""

    type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """The shape of one decoder-only (MoE) language model, independent of where its weights come from."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    qk_norm: str = "head"  # RMSNorm of q and k: per head (Qwen3), over the whole projection (OLMoE), "none"
    clip_qkv: float | None = None  # q, k, v projections clamped to ±this (OLMoE's option)
    o_proj_bias: bool | None = None  # the output projection's bias; None: as attention_bias (GLM: False)
    # the router: softmax over the experts (Qwen, Mixtral, OLMoE); sigmoid scores chosen with a learned
    # correction bias within the best topk_group of n_group groups (GLM-4.5, DeepSeek-V3's noaux_tc); or
    # "topk_softmax": the top-k logits, then a softmax over them (gpt-oss)
    router_scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0  # a dense SwiGLU of n · moe_intermediate_size beside the routed experts
    router_bias: bool = False  # the router's linear layer has a bias (gpt-oss)
    # what experts compute between their projections (moe/expert_fn.py): "silu", gpt-oss's "clamped", or
    # DeepSeek-V4's "clamped_silu"; the clamped kinds bound the gate and up projections at swiglu_limit
    expert_act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False  # experts carry gate/up and down biases (gpt-oss)
    attention_sinks: bool = False  # a learned logit per head in every softmax's denominator (gpt-oss)
    sliding_window: int | None = None  # keys a query of a sliding layer sees, itself included
    sliding_layers: tuple[int, ...] = ()
    # multi-head latent attention (DeepSeek-V3): kv_lora_rank > 0 turns it on (models/mla.py)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    mla_rope: bool = True  # Kimi-Linear's latent attention has no rope
    # DeepSeek sparse attention's indexer (models/dsa.py): index_topk > 0 turns it on
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    index_rope_interleave: bool = False  # the indexer's rope on pairs (GLM-5), not halves (DeepSeek-V3.2)
    indexer_shared_layers: tuple[int, ...] = ()  # layers reusing the previous indexing layer's choice (GLM-5)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def is_moe_layer(self, layer: int) -> bool:
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def rotary_dim(self) -> int:
        """Dims of a head that rope rotates."""
        if self.kv_lora_rank:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def kv_dims(self) -> tuple[int, int, int]:
        """What the KV cache holds per attention layer and position: (heads, key dims, value dims); MLA
        caches one latent and its rope key, no values."""
        if self.kv_lora_rank:  # the latent and its rope key; the indexer's key, where there is one
            return 1, self.kv_lora_rank + self.qk_rope_head_dim, self.index_head_dim if self.index_topk else 0
        return self.num_kv_heads, self.head_dim, self.head_dim

    @property
    def expert_numel(self) -> int:
        """Elements of one expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size


PREFILL_STREAM_CHOICES = ("auto", "on", "off")
# The context per sequence when none is given: the KV cache is allocated once for all of it, per slot.
DEFAULT_CONTEXT = 8192


@dataclass(frozen=True)
class MoeConfig:
    """Expert placement choices (`--moe-*` flags). None means: decide from the machine."""

    backend: str = "auto"
    cache_size: int | None = None  # expert slots on the compute device
    cache_ratio: float | None = None  # ... or a fraction of the pool
    kv_reserve_tokens: int = 8192  # VRAM held back for prefix-cache K/V beyond the static KV pool
    vram_budget: str | None = None  # the engine's device memory cap: GiB ("20", "20GiB") or a share ("0.5")
    cpu_layers: str | None = None  # "3,7,11" ids, "4" the first four MoE layers, "0.25" a fraction
    hybrid_max_fetch: int | None = None
    prefetch: int = 0  # router-lookahead prefetch: experts of the next MoE layer fetched per layer step
    cpu_threads: int | None = None
    cpu_int8_act: bool = False  # CPU dots of quantized experts against int8 activation blocks
    pcie_gbps: float | None = None  # B_P; None: from this machine's bandwidth profile, if any
    host_gbps: float | None = None  # B_H; likewise
    fetch_correction: float = 1.0  # measured best q/m over B_P/B_H (from the profile; 0: fetch none)
    reprofile: bool = True  # probe B_P and B_H at safe points while running
    share_cores: bool = True  # CPU threads follow the cores other processes leave (at safe points)
    reprofile_interval_s: float = 30.0
    prefill_stream: str = "auto"  # stream whole expert layers in prefill: auto (when it wins) | on | off
    prefill_hit_d2d: bool = False  # streamed experts already resident are copied on the device
    prefill_overlap: bool = True  # copy the next layer behind this layer's compute
    host_batch_scale: tuple[tuple[int, float], ...] = ()  # B_H(n)/B_H(1) at n tokens per expert (profile)
    device_pairs_per_s: float | None = None  # device expert compute, (token, expert) pairs/s (profile)

    def __post_init__(self) -> None:
        check_choice("--moe-backend", self.backend, MOE_BACKEND_NAMES)
        check_flags(
            ("--moe-cache-size", self.cache_size, COUNT),
            ("--moe-cache-ratio", self.cache_ratio, FRACTION),
            ("--kv-reserve-tokens", self.kv_reserve_tokens, COUNT),
            ("--moe-hybrid-max-fetch", self.hybrid_max_fetch, POSITIVE_INT),
            ("--moe-prefetch", self.prefetch, PREFETCH_WIDTH),
            ("--moe-cpu-threads", self.cpu_threads, CPU_THREADS),
            ("--moe-pcie-gbps", self.pcie_gbps, POSITIVE),
            ("--moe-host-gbps", self.host_gbps, POSITIVE),
            ("reprofile interval", self.reprofile_interval_s, NON_NEGATIVE),
            ("fetch correction", self.fetch_correction, NON_NEGATIVE),
        )
        check_choice("--moe-prefill-stream", self.prefill_stream, PREFILL_STREAM_CHOICES)
        cpu_layers_form(self.cpu_layers)
        vram_budget_form(self.vram_budget)
        if self.cache_size is not None and self.cache_ratio is not None:
            raise flag_error("--moe-cache-size", "give it or --moe-cache-ratio, not both")


@dataclass(frozen=True)
class EngineConfig:
    """What the user chose at the edge: where the model is and how to run it."""

    model_path: Path
    device: str = "auto"
    dtype: str = "auto"
    moe: MoeConfig = field(default_factory=MoeConfig)
    max_seq_len: int | None = None  # the context per sequence; None: the model's, at most DEFAULT_CONTEXT
    max_running: int = 1  # sequences held at once: slots of the static KV cache
    max_prefill_tokens: int = 8192  # prompt tokens per forward pass
    verify: bool | None = None  # checksum an FTW folder as it loads: always, never, None: where cores allow
    state_checkpoints: int = 16  # recurrent-state checkpoints kept for the cached sequence (hybrid models)
    checkpoint_policy: str = "anchors"  # anchors | interval | none
    checkpoint_interval: int = 64  # spacing of the interval policy

    def __post_init__(self) -> None:
        check_device(self.device)
        normalize_dtype(self.dtype)
        check_choice("--checkpoint-policy", self.checkpoint_policy, CHECKPOINT_POLICIES)
        check_flags(
            ("--state-checkpoints", self.state_checkpoints, COUNT),
            ("checkpoint interval", self.checkpoint_interval, POSITIVE_INT),
            ("--max-prefill-tokens", self.max_prefill_tokens, POSITIVE_INT),
            ("max_seq_len", self.max_seq_len, POSITIVE_INT),
            ("--max-running-requests", self.max_running, POSITIVE_INT),
        )


GIB = 1 << 30
_SIZE_UNITS = {"": GIB, "g": GIB, "gb": GIB, "gib": GIB, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20}


def vram_budget_form(spec: str | None) -> tuple[str, float] | None:
    """`--vram-budget`: ("share", f) for a share of the device's memory ("0.5", "50%"; a plain number up
    to 1), ("bytes", n) for a size ("20" and "20GiB" are GiB, "512MiB"); None when not given."""
    if spec is None:
        return None
    text = spec.strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz%")
    unit = text[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit == "%" and 0 < value <= 100:
        return ("share", value / 100)
    if unit == "" and 0 < value <= 1:
        return ("share", value)
    if unit in _SIZE_UNITS and value > 0:
        return ("bytes", value * _SIZE_UNITS[unit])
    raise flag_error(
        "--vram-budget", f"expected GiB ('20', '20GiB', '512MiB') or a share ('0.5', '50%'), got {spec!r}"
    )


def cpu_layers_form(spec: str | None) -> tuple[str, Any] | None:
    """`--moe-cpu-layers` without the model: ("ids", [3, 7, 11]) for ids with commas ("3,7,11" or "7,"),
    ("count", 4) for the first four MoE layers, ("fraction", 0.25) for that share of them, the first ones."""
    if spec is None or not spec.strip():
        return None
    text = spec.strip()
    try:
        if "," in text:
            ids = [int(part) for part in text.split(",") if part.strip()]
            form: tuple[str, Any] = ("ids", ids)
            ok = all(i >= 0 for i in ids)
        elif "." in text:
            form = ("fraction", float(text))
            ok = 0 <= form[1] <= 1
        else:
            form = ("count", int(text))
            ok = form[1] >= 0
    except ValueError:
        raise flag_error(
            "--moe-cpu-layers", f"expected ids '3,7,11', a count or a fraction, got {spec!r}"
        ) from None
    if not ok:
        raise flag_error("--moe-cpu-layers", f"{spec}: ids and counts are >= 0, a fraction is in [0, 1]")
    return form


def parse_cpu_layers(spec: str | None, moe_layers: tuple[int, ...]) -> frozenset[int]:
    """`--moe-cpu-layers` (see cpu_layers_form) -> the MoE layer ids whose misses compute on the CPU."""
    form = cpu_layers_form(spec)
    if form is None:
        return frozenset()
    if not moe_layers:
        raise FreeTokenError(f"--moe-cpu-layers: {spec}: the model has no MoE layers")
    kind, value = form
    if kind == "ids":
        unknown = [i for i in value if i not in moe_layers]
        if unknown:
            raise FreeTokenError(
                f"--moe-cpu-layers: {spec}: {unknown} are not MoE layers (those are {moe_layers[0]}.."
                f"{moe_layers[-1]})"
            )
        return frozenset(value)
    if kind == "fraction":
        return frozenset(moe_layers[: round(value * len(moe_layers))])
    if value > len(moe_layers):
        raise FreeTokenError(f"--moe-cpu-layers: {spec}: the model has {len(moe_layers)} MoE layers")
    return frozenset(moe_layers[:value])


def normalize_dtype(name: str) -> str:
    """`--dtype`: auto, float32 (fp32) or bfloat16 (bf16) -> auto or the full name."""
    key = name.lower()
    if key == "auto":
        return "auto"
    if key not in DTYPE_ALIASES:
        raise flag_error("--dtype", f"unsupported dtype {name!r}; choose one of: auto, {', '.join(DTYPES)}")
    return DTYPE_ALIASES[key]


def rope_from_hf(raw: dict[str, Any], source: str = "config.json") -> RopeConfig:
    """Normalise HF rope fields: `rope_parameters` (new) or `rope_theta` + `rope_scaling` (old)."""
    top = JsonObject(raw, source)
    params = top.child("rope_parameters" if raw.get("rope_parameters") else "rope_scaling")

    def either(key: str, kind: Kind, default: Any) -> Any:  # the rope object's value, else the top level's
        return params.get(key, kind) if params.raw.get(key) is not None else top.get(key, kind, default)

    rope_type = params.choice("rope_type", ROPE_TYPES, None) or params.choice("type", ROPE_TYPES, "default")
    original = either("original_max_position_embeddings", POSITIVE_INT, None)
    max_positions = top.get("max_position_embeddings", POSITIVE_INT, 32768)
    if rope_type == "yarn" and original is None:
        original = max_positions
    factor = params.get("factor", POSITIVE, None)
    if factor is None:
        if rope_type == "linear":
            raise params.error("factor", "missing (rope type 'linear' needs it)")
        factor = max_positions / original if rope_type == "yarn" else 1.0
    return RopeConfig(
        type=rope_type,
        theta=either("rope_theta", POSITIVE, 10000.0),
        factor=float(factor),
        original_max_position_embeddings=original,
        attention_factor=params.get("attention_factor", NUMBER, None),
        beta_fast=params.get("beta_fast", NUMBER, None) or 32.0,
        beta_slow=params.get("beta_slow", NUMBER, None) or 1.0,
        mscale=params.get("mscale", NUMBER, None),
        mscale_all_dim=params.get("mscale_all_dim", NUMBER, None),
        truncate=params.get("truncate", BOOL, True),
        partial_rotary_factor=either("partial_rotary_factor", FRACTION, 1.0),
    )
