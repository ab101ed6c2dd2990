"""Frozen configs built once at the edge: the model's shape and the engine's choices."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freetoken.errors import FreeTokenError

ROPE_TYPES = ("default", "linear", "yarn")
DTYPES = ("float32", "bfloat16")
DTYPE_ALIASES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}


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
    def expert_numel(self) -> int:
        """Elements of one expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size


PREFILL_STREAM_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class MoeConfig:
    """Expert placement choices (`--moe-*` flags). None means: decide from the machine."""

    backend: str = "auto"
    cache_size: int | None = None  # expert slots on the compute device
    cache_ratio: float | None = None  # ... or a fraction of the pool
    kv_reserve_tokens: int = 8192  # VRAM held back for the KV cache before sizing the slots
    cpu_layers: str | None = None  # "3,7,11" ids, "4" the first four MoE layers, "0.25" a fraction
    hybrid_max_fetch: int | None = None
    cpu_threads: int | None = None
    pcie_gbps: float | None = None  # B_P; None: from this machine's bandwidth profile, if any
    host_gbps: float | None = None  # B_H; likewise
    fetch_correction: float = 1.0  # measured best q/m over B_P/B_H (from the profile)
    reprofile: bool = True  # probe B_P and B_H at safe points while running
    reprofile_interval_s: float = 30.0
    prefill_stream: str = "auto"  # stream whole expert layers in prefill: auto (when it wins) | on | off
    prefill_hit_d2d: bool = False  # streamed experts already resident are copied on the device
    prefill_overlap: bool = True  # copy the next layer behind this layer's compute
    host_batch_scale: tuple[tuple[int, float], ...] = ()  # B_H(n)/B_H(1) at n tokens per expert (profile)
    device_pairs_per_s: float | None = None  # device expert compute, (token, expert) pairs/s (profile)

    def __post_init__(self) -> None:
        checks = (
            ("--moe-cache-size", self.cache_size, lambda v: v >= 0),
            ("--moe-cache-ratio", self.cache_ratio, lambda v: 0 < v <= 1),
            ("--kv-reserve-tokens", self.kv_reserve_tokens, lambda v: v >= 0),
            ("--moe-hybrid-max-fetch", self.hybrid_max_fetch, lambda v: v >= 1),
            ("--moe-cpu-threads", self.cpu_threads, lambda v: v >= 1),
            ("--moe-pcie-gbps", self.pcie_gbps, lambda v: v > 0),
            ("--moe-host-gbps", self.host_gbps, lambda v: v > 0),
            ("reprofile interval", self.reprofile_interval_s, lambda v: v >= 0),
            ("fetch correction", self.fetch_correction, lambda v: v > 0),
        )
        for flag, value, ok in checks:
            if value is not None and not ok(value):
                raise FreeTokenError(f"{flag} {value} is out of range")
        if self.prefill_stream not in PREFILL_STREAM_CHOICES:
            choices = ", ".join(PREFILL_STREAM_CHOICES)
            raise FreeTokenError(f"--moe-prefill-stream {self.prefill_stream!r}: expected one of {choices}")
        if self.cache_size is not None and self.cache_ratio is not None:
            raise FreeTokenError("give --moe-cache-size or --moe-cache-ratio, not both")


@dataclass(frozen=True)
class EngineConfig:
    """What the user chose at the edge: where the model is and how to run it."""

    model_path: Path
    device: str = "auto"
    dtype: str = "auto"
    moe: MoeConfig = field(default_factory=MoeConfig)
    max_seq_len: int | None = None
    max_prefill_tokens: int = 8192  # prompt tokens per forward pass
    verify: bool = False  # check every checksum of an FTW folder while loading
    state_checkpoints: int = 16  # recurrent-state checkpoints kept for the cached sequence (hybrid models)
    checkpoint_policy: str = "anchors"  # anchors | interval | none
    checkpoint_interval: int = 64  # spacing of the interval policy

    def __post_init__(self) -> None:
        if self.checkpoint_policy not in ("anchors", "interval", "none"):
            raise FreeTokenError(
                f"--checkpoint-policy {self.checkpoint_policy!r}: expected one of anchors, interval, none"
            )
        if self.state_checkpoints < 0 or self.checkpoint_interval < 1:
            raise FreeTokenError("--state-checkpoints must be >= 0 and the checkpoint interval >= 1")
        if self.max_prefill_tokens < 1:
            raise FreeTokenError(f"--max-prefill-tokens {self.max_prefill_tokens} is out of range")


def parse_cpu_layers(spec: str | None, moe_layers: tuple[int, ...]) -> frozenset[int]:
    """`--moe-cpu-layers`: ids with commas ("3,7,11" or "7,"), a count ("4": the first four MoE layers),
    or a fraction ("0.25" of the MoE layers, the first ones)."""
    if spec is None or not spec.strip():
        return frozenset()
    if not moe_layers:
        raise FreeTokenError(f"--moe-cpu-layers {spec}: the model has no MoE layers")
    text = spec.strip()
    try:
        if "," in text:
            ids = [int(part) for part in text.split(",") if part.strip()]
            unknown = [i for i in ids if i not in moe_layers]
            if unknown:
                raise FreeTokenError(
                    f"--moe-cpu-layers {spec}: {unknown} are not MoE layers (those are {moe_layers[0]}.."
                    f"{moe_layers[-1]})"
                )
            return frozenset(ids)
        if "." in text:
            fraction = float(text)
            if not 0 <= fraction <= 1:
                raise FreeTokenError(f"--moe-cpu-layers {spec}: a fraction must be in [0, 1]")
            return frozenset(moe_layers[: round(fraction * len(moe_layers))])
        count = int(text)
    except ValueError:
        raise FreeTokenError(
            f"--moe-cpu-layers {spec!r}: expected ids '3,7,11', a count or a fraction"
        ) from None
    if not 0 <= count <= len(moe_layers):
        raise FreeTokenError(f"--moe-cpu-layers {spec}: the model has {len(moe_layers)} MoE layers")
    return frozenset(moe_layers[:count])


def normalize_dtype(name: str) -> str:
    key = name.lower()
    if key == "auto":
        return "auto"
    if key not in DTYPE_ALIASES:
        raise FreeTokenError(f"unsupported dtype {name!r}; choose one of: auto, {', '.join(DTYPES)}")
    return DTYPE_ALIASES[key]


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object, turning every failure into a one-line error naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FreeTokenError(f"{path}: file not found") from None
    except OSError as exc:
        raise FreeTokenError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FreeTokenError(
            f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    if not isinstance(value, dict):
        raise FreeTokenError(f"{path}: expected a JSON object")
    return value


def rope_from_hf(raw: dict[str, Any], source: str = "config.json") -> RopeConfig:
    """Normalise HF rope fields: `rope_parameters` (new) or `rope_theta` + `rope_scaling` (old)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise FreeTokenError(
            f"{source}: unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    original = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if rope_type == "yarn" and original is None:
        original = raw.get("max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        if rope_type == "linear":
            raise FreeTokenError(f"{source}: rope type 'linear' needs a 'factor'")
        factor = raw["max_position_embeddings"] / original if rope_type == "yarn" else 1.0
    return RopeConfig(
        type=rope_type,
        theta=float(theta),
        factor=float(factor),
        original_max_position_embeddings=original,
        attention_factor=params.get("attention_factor"),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        partial_rotary_factor=float(
            params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        ),
    )


def eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def load_model_config(model_dir: Path) -> ModelConfig:
    """Parse `config.json` of a model folder through the architecture registry."""
    from freetoken.runtime.models import get_architecture

    path = Path(model_dir) / "config.json"
    raw = read_json(path)
    model_type = raw.get("model_type")
    if not model_type:
        raise FreeTokenError(f"{path}: missing field 'model_type'")
    return get_architecture(model_type).parse_config(raw, str(path))
