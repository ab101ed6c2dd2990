"""Bandwidth profiles: what `bench bw` measured on this machine, cached per machine key.

The runtime reads the profile of this machine (never another's) for B_P, B_H and the recommended
backend; flags override it.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from freetoken import __version__
from freetoken.env import profiles_dir
from freetoken.errors import FreeTokenError
from freetoken.runtime.config import MOE_BACKEND_NAMES, MoeConfig
from freetoken.runtime.json_keys import (
    COUNT,
    FRACTION,
    NON_NEGATIVE,
    NUMBER,
    OBJECT,
    POSITIVE,
    POSITIVE_INT,
    REQUIRED,
    SHARE,
    TEXT,
    JsonObject,
    Kind,
    read_json,
    shown,
)

PROFILE_VERSION = 1


@dataclass(frozen=True)
class MachineIdentity:
    gpu_name: str | None
    gpu_uuid: str | None
    cpu_model: str
    threads: int

    @property
    def key(self) -> str:
        raw = "|".join(
            str(v) for v in (self.gpu_uuid or self.gpu_name or "no-gpu", self.cpu_model, self.threads)
        )
        return hashlib.sha256(raw.encode()).hexdigest()[:16]


def this_machine(threads: int | None = None) -> MachineIdentity:
    import torch

    from freetoken.runtime.moe.kernels.cpu_experts import branch_threads
    from freetoken.runtime.moe.kernels.loader import cpu_model

    gpu_name = gpu_uuid = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu_name = props.name
        gpu_uuid = str(getattr(props, "uuid", "")) or None
    return MachineIdentity(gpu_name, gpu_uuid, cpu_model(), threads or branch_threads())


@dataclass(frozen=True)
class BandwidthProfile:
    machine_key: str
    machine: dict[str, Any]
    created: float  # unix time
    versions: dict[str, str]
    expert_shape: dict[str, int]  # hidden, intermediate, top_k, bytes
    host_read: float  # bytes/s, STREAM-like read over all threads
    b_h: float  # bytes/s, the runtime's CPU expert kernel at batch 1
    b_p: float | None  # bytes/s, expert fills through the runtime's copy path; None without CUDA
    h2d: float | None
    d2h: float | None
    cpu_fixed_s: float  # fixed cost of one CPU-branch launch (hand-off and copies), seconds
    kernel: str  # "compiled" or "torch"
    b_h_batch: dict[str, float] = field(default_factory=dict)  # tokens per expert -> B_H there
    device_pairs_s: float | None = None  # device expert compute, (token, expert) pairs/s at 512 tokens
    b_p_gather: float | None = None  # bytes/s, the same fills by the graph's gather kernel over UVA
    overlap: list[dict[str, float]] = field(default_factory=list)  # [{q, seconds}]: one layer step of m
    # misses (expert_shape.overlap_misses), q fetched and m − q through the CPU branch, at once
    overlap_path: str = "read_back"  # stream: as a captured decode step (gather fills, native branch)
    measured_fetch_fraction: float | None = None  # best q/m from the overlapped runs
    model_fetch_fraction: float | None = None  # min(1, B_P/B_H)
    recommended_backend: str = "cpu"
    # `bench bw --validate`: {tok_s per backend, fastest, model_pick}. When the real decode's fastest is
    # not the pick of the measured layer steps, recommended_backend is the fastest and model_pick the other.
    validated: dict[str, Any] | None = None
    version: int = PROFILE_VERSION

    def fetch_correction(self) -> float:
        """Measured best q/m over the linear model's B_P/B_H (1 when nothing was measured; 0 where the
        best was to fetch nothing, so hybrid leaves every miss to the CPU as cpu does)."""
        if self.measured_fetch_fraction is None or not self.model_fetch_fraction:
            return 1.0
        return self.measured_fetch_fraction / self.model_fetch_fraction

    def age_s(self) -> float:
        return time.time() - self.created

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def profile_path(key: str) -> Path:
    return profiles_dir() / f"{key}.json"


def save_profile(profile: BandwidthProfile, path: Path | None = None) -> Path:
    path = path or profile_path(profile.machine_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(profile.as_dict(), indent=2) + "\n")
    tmp.replace(path)
    return path


SHAPE_KEYS = ("hidden", "intermediate", "top_k", "bytes")
OVERLAP_ROWS = Kind(
    "a list of {q, seconds} rows",
    lambda v: (
        isinstance(v, list)
        and all(
            isinstance(r, dict) and COUNT.check(r.get("q")) and POSITIVE.check(r.get("seconds")) for r in v
        )
    ),
)
# key -> (kind, what an absent or null key means; REQUIRED: it must be set)
PROFILE_KEYS: dict[str, tuple[Kind, Any]] = {
    "machine_key": (TEXT, REQUIRED),
    "machine": (OBJECT, REQUIRED),
    "created": (NUMBER, REQUIRED),
    "versions": (OBJECT, REQUIRED),
    "expert_shape": (OBJECT, REQUIRED),
    "host_read": (POSITIVE, REQUIRED),
    "b_h": (POSITIVE, REQUIRED),
    "b_p": (POSITIVE, None),
    "b_p_gather": (POSITIVE, None),
    "h2d": (POSITIVE, None),
    "d2h": (POSITIVE, None),
    "cpu_fixed_s": (NON_NEGATIVE, REQUIRED),
    "kernel": (TEXT, REQUIRED),
    "b_h_batch": (OBJECT, {}),
    "device_pairs_s": (POSITIVE, None),
    "overlap": (OVERLAP_ROWS, []),
    "overlap_path": (TEXT, "read_back"),
    "measured_fetch_fraction": (SHARE, None),
    "model_fetch_fraction": (FRACTION, None),
    "recommended_backend": (TEXT, "cpu"),
    "validated": (OBJECT, None),
    "version": (POSITIVE_INT, REQUIRED),
}


def read_profile(path: Path) -> BandwidthProfile:
    """A saved profile, every key checked: a wrong one is one line naming the file and the key."""
    profile = JsonObject(read_json(path), str(path))
    if profile.raw.get("version") != PROFILE_VERSION:
        raise profile.error("version", f"expected {PROFILE_VERSION}, got {shown(profile.raw.get('version'))}")
    for key in profile.raw:
        if key not in PROFILE_KEYS:
            raise profile.error(key, "unknown key")
    values = {key: profile.get(key, kind, default) for key, (kind, default) in PROFILE_KEYS.items()}
    profile.choice("recommended_backend", tuple(n for n in MOE_BACKEND_NAMES if n != "auto"), "cpu")
    profile.choice("overlap_path", ("stream", "read_back"), "read_back")
    shape = profile.child("expert_shape")
    for key in SHAPE_KEYS:
        shape.get(key, POSITIVE_INT)
    batch = profile.child("b_h_batch")
    for key in batch.raw:
        if not (key.isdigit() and int(key) > 0):
            raise batch.error(key, "expected a token count as the key")
        batch.get(key, POSITIVE)
    return BandwidthProfile(**values)


def load_profile(path: Path | None = None, machine: MachineIdentity | None = None) -> BandwidthProfile | None:
    """This machine's profile, or None. A profile measured elsewhere is ignored with a warning."""
    machine = machine or this_machine()
    path = path or profile_path(machine.key)
    if not path.exists():
        return None
    try:
        profile = read_profile(path)
    except FreeTokenError as exc:
        warnings.warn(f"ignoring bandwidth profile: {exc}", stacklevel=2)
        return None
    if profile.machine_key != machine.key:
        warnings.warn(
            f"ignoring bandwidth profile {path}: measured on another machine "
            f"({profile.machine.get('gpu_name') or 'no GPU'}, {profile.machine.get('cpu_model')}, "
            f"{profile.machine.get('threads')} threads); run `freetoken bench bw` here",
            stacklevel=2,
        )
        return None
    return profile


def current_versions() -> dict[str, str]:
    import torch

    return {
        "freetoken": __version__,
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "python": platform.python_version(),
    }


def with_profile(moe: MoeConfig, profile: BandwidthProfile | None) -> MoeConfig:
    """Fill the bandwidths the user did not give from the profile; flags always win. With both taken from
    the profile, its measured split corrects the linear model too."""
    if profile is None:
        return moe
    pcie = moe.pcie_gbps if moe.pcie_gbps is not None else (profile.b_p / 1e9 if profile.b_p else None)
    host = moe.host_gbps if moe.host_gbps is not None else profile.b_h / 1e9
    correction = moe.fetch_correction
    if moe.pcie_gbps is None and moe.host_gbps is None:
        correction = profile.fetch_correction()
    scale = tuple(
        sorted((int(n), bw / profile.b_h) for n, bw in {"1": profile.b_h, **profile.b_h_batch}.items())
    )
    return replace(
        moe,
        pcie_gbps=pcie,
        host_gbps=host,
        fetch_correction=correction,
        host_batch_scale=moe.host_batch_scale or scale,
        device_pairs_per_s=moe.device_pairs_per_s or profile.device_pairs_s,
    )
