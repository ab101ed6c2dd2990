"""What `ft models` lists: the local Hugging Face cache, FreeToken's own models ($FREETOKEN_HOME/models)
or given paths; each with its format, architecture, and whether FreeToken can run it (else why not).
Only metadata is read (config.json, FTW manifest, GGUF header), never a weight, and torch is not
imported. A broken entry is listed with its one-line reason, never raised."""

from __future__ import annotations

import json
import re
import shutil
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from freetoken.env import models_dir
from freetoken.errors import FreeTokenError
from freetoken.runtime.json_keys import read_json
from freetoken.runtime.models import ARCHITECTURES, supported_architectures

# Copies of constants from modules that import torch; tests keep each equal to its original.
FTW_MANIFEST = "ftw.json"  # formats.ftw.MANIFEST
FTW_FORMAT, FTW_VERSIONS = "freetoken-ftw", (1, 2)  # formats.ftw.FORMAT, formats.ftw.READABLE_VERSIONS
DEMO_FOLDER = "demo-v1"  # runtime.demo.DEMO_NAME
GGUF_ARCHITECTURES = {  # formats.gguf_meta.ARCHITECTURES
    "qwen3moe": "qwen3_moe", "olmoe": "olmoe", "glm4moe": "glm4_moe", "minimax-m2": "minimax_m2",
    "gpt-oss": "gpt_oss", "llama": "mixtral", "deepseek2": "deepseek_v3", "glm-dsa": "glm_moe_dsa",
    "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next", "deepseek32": "deepseek_v32",
    "kimi-linear": "kimi_linear", "deepseek4": "deepseek_v4",
}  # fmt: skip
DEMO = "demo"
BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2}
GGUF_SHARD = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf$")
GGUF_EXPERTS = re.compile(r"blk\.\d+\.ffn_(gate|up|down|gate_up)_exps\.weight")


@dataclass(frozen=True)
class ModelEntry:
    name: str  # what to pass to `ft run`
    path: Path
    source: str  # "hf-cache", "freetoken" (under $FREETOKEN_HOME/models) or "path"
    format: str  # "safetensors", "ftw", "gguf"; "" when it is not a model at all
    architecture: str | None  # config.json's model_type (else architectures[0]), or general.architecture
    supported: bool
    reason: str | None  # why FreeToken cannot run it; None exactly when supported
    size_bytes: int
    expert_bytes: int | None  # the routed experts' weights as stored; None when not cheaply known
    expert_types: tuple[str, ...] = ()  # how the file stores them (GGUF types, FTW codecs); () unknown

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "path": str(self.path)}


# (architecture, why it cannot run, expert bytes, expert types as stored)
Meta = tuple[str | None, str | None, int | None, tuple[str, ...]]


def hf_cache_dir() -> Path:
    """The hub cache huggingface_hub uses ($HF_HUB_CACHE, else $HF_HOME/hub, else its default)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


def first_gguf_shard(path: Path) -> bool:
    """A .gguf file that stands for a model: a single file or the first of its shards."""
    match = GGUF_SHARD.match(path.name)
    return path.suffix == ".gguf" and (match is None or int(match.group(2)) == 1)


def gguf_files(path: Path) -> list[Path]:
    """The file, or all its shards when it is `-00001-of-0000N.gguf` (missing ones included)."""
    if not (match := GGUF_SHARD.match(path.name)):
        return [path]
    stem, count = match.group(1), int(match.group(3))
    return [path.with_name(f"{stem}-{n:05d}-of-{count:05d}.gguf") for n in range(1, count + 1)]


def _size(path: Path) -> int:
    try:
        files = path.rglob("*") if path.is_dir() else [path]
        return sum(p.stat().st_size for p in files if p.is_file())
    except OSError:
        return 0


def config_expert_bytes(raw: dict[str, Any]) -> int | None:
    """MoE layers x experts x 3 x hidden x moe_intermediate x bytes per element of the stored dtype."""
    text = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    dtype = next((str(c[k]) for c in (text, raw) for k in ("dtype", "torch_dtype") if c.get(k)), None)
    if "quantization_config" in raw or "quantization_config" in text or dtype not in BYTES_PER_ELEMENT:
        return None  # quantized weights are not `dtype`-sized
    try:
        experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
        layers, hidden, inter = (
            int(text[k]) for k in ("num_hidden_layers", "hidden_size", "moe_intermediate_size")
        )
        step, dense = int(text.get("decoder_sparse_step") or 1), set(text.get("mlp_only_layers") or ())
        moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return moe_layers * experts * 3 * hidden * inter * BYTES_PER_ELEMENT[dtype] if experts > 0 else None


def _ftw_experts(folder: Path) -> tuple[int | None, tuple[str, ...], str | None]:
    """(expert bytes, their codecs or dtypes, a problem) from an FTW manifest."""
    path = folder / FTW_MANIFEST
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw.get("format") != FTW_FORMAT or raw.get("version") not in FTW_VERSIONS:
            versions = " or ".join(map(str, FTW_VERSIONS))
            return None, (), f"{path}: not an FTW manifest this FreeToken reads (version {versions})"
        banks = [t for t in raw["tensors"] if t.get("kind") in ("gate_up", "down")]
        types = tuple(sorted({str(t.get("codec") or t["dtype"]) for t in banks}))
        return sum(int(t["nbytes"]) for t in banks), types, None
    except (OSError, ValueError, AttributeError, KeyError, TypeError) as exc:  # JSON and UTF-8 errors too
        return None, (), f"{path}: unreadable FTW manifest ({type(exc).__name__}: {exc})"


def folder_meta(folder: Path, fmt: str) -> Meta:
    try:
        raw = read_json(folder / "config.json")
    except FreeTokenError as exc:
        return None, str(exc), None, ()
    model_type, archs = raw.get("model_type"), raw.get("architectures")
    arch = next(
        (a for a in (model_type, *(archs if isinstance(archs, list) else ())) if isinstance(a, str)), None
    )
    reason, supported = None, ", ".join(supported_architectures())
    if not isinstance(model_type, str):
        reason = f"{folder / 'config.json'}: no 'model_type'"
    elif model_type not in ARCHITECTURES:
        reason = f"architecture {model_type!r} is not supported (supported: {supported})"
    if fmt == "ftw":
        experts, types, problem = _ftw_experts(folder)
        return arch, reason or problem, experts, types
    if reason is None and not any(folder.glob("*.safetensors")):
        reason = f"{folder}: no .safetensors weights"
    return arch, reason, config_expert_bytes(raw), ()


def gguf_header(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    """(scalar and string key/values, (bytes, GGML type id) of each tensor) of one GGUF file, parsed from
    its header: arrays are skipped, not built (the gguf package's reader takes seconds on a 150k-token
    vocabulary)."""
    from freetoken.formats.gguf_header import read_header

    header = read_header(path, arrays=False)
    return header.fields, {t.name: (t.n_bytes, t.ggml_type) for t in header.tensors}


def gguf_type_name(type_id: int) -> str:
    """A GGML type id's name as the gguf package spells it (Q4_K, BF16, ...), or `type N`."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


def gguf_meta(path: Path) -> Meta:
    fields: dict[str, Any] = {}
    experts, types = 0, set()
    for shard in gguf_files(path):
        if not shard.is_file():
            return None, f"{path}: shard {shard.name} is missing", None, ()
        try:
            shard_fields, tensors = gguf_header(shard)
        except (OSError, ValueError, KeyError, struct.error) as exc:
            return None, f"{shard}: not a readable GGUF file ({type(exc).__name__}: {exc})", None, ()
        fields = {**shard_fields, **fields}
        banks = [info for name, info in tensors.items() if GGUF_EXPERTS.fullmatch(name)]
        experts += sum(n for n, _ in banks)
        types |= {gguf_type_name(t) for _, t in banks}
    arch, kind, reason = fields.get("general.architecture"), fields.get("tokenizer.ggml.model"), None
    if arch not in GGUF_ARCHITECTURES:
        reason = f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})"
    elif arch == "llama" and not fields.get("llama.expert_count"):
        reason = "GGUF architecture 'llama' without experts (a dense model): not supported"
    elif kind not in ("gpt2", "llama"):
        reason = (
            f"tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' and SentencePiece 'llama' are)"
        )
    return (arch if isinstance(arch, str) else None), reason, experts or None, tuple(sorted(types))


def inspect_path(path: Path, name: str, source: str, size: int | None = None) -> ModelEntry:
    """One entry for `path`, whatever is there (or not)."""
    try:
        if path.is_dir() and (path / FTW_MANIFEST).is_file():
            fmt, meta = "ftw", folder_meta(path, "ftw")
        elif path.is_dir() and (path / "config.json").is_file():
            fmt, meta = "safetensors", folder_meta(path, "safetensors")
        elif path.is_file() and path.suffix == ".gguf":
            fmt, meta = "gguf", gguf_meta(path)
            size = size if size is not None else sum(_size(p) for p in gguf_files(path))
        elif path.exists():
            fmt, meta = "", (None, f"{path}: not a model folder (no config.json) or .gguf file", None, ())
        else:
            fmt, meta = "", (None, f"{path}: no such file or folder", None, ())
    except OSError as exc:  # a folder it may not look into, say
        fmt, meta = "", (None, f"{path}: cannot read ({exc.strerror or exc})", None, ())
    arch, reason, experts, types = meta
    size = _size(path) if size is None else size
    return ModelEntry(name, path, source, fmt, arch, reason is None, reason, size, experts, types)


def is_model(path: Path) -> bool:
    """A folder with an FTW manifest or a config.json, or a .gguf file (the first of its shards)."""
    if path.is_dir():
        return (path / FTW_MANIFEST).is_file() or (path / "config.json").is_file()
    return path.is_file() and first_gguf_shard(path)


def hf_cache_models() -> list[ModelEntry]:
    """Model repos of the local Hugging Face cache, at `main` (else their newest snapshot)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(hf_cache_dir())
    except (CacheNotFound, OSError, ValueError):  # no cache, a file in its place, an unreadable one
        return []
    entries = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        revisions = sorted(repo.revisions, key=lambda r: ("main" not in r.refs, -r.last_modified))
        if repo.repo_type != "model" or not revisions:
            continue
        rev, snap = revisions[0], revisions[0].snapshot_path
        # a repo id resolves to `main` only; other snapshots are named by their path
        name = repo.repo_id if "main" in rev.refs else str(snap)
        ggufs = sorted(p for p in snap.rglob("*.gguf") if first_gguf_shard(p))
        if ggufs and not (snap / "config.json").exists():  # one entry per file, named by its path
            entries += [inspect_path(p, str(p), "hf-cache") for p in ggufs]
        else:
            entries.append(inspect_path(snap, name, "hf-cache", rev.size_on_disk))
    return entries


def own_models() -> list[ModelEntry]:
    """Folders and .gguf files directly under $FREETOKEN_HOME/models (hidden ones are in-progress writes)."""
    root = models_dir()
    if not root.is_dir():
        return []
    paths = [
        p for p in sorted(root.iterdir()) if p.name[0] != "." and (p.suffix != ".gguf" or first_gguf_shard(p))
    ]
    return [inspect_path(p, DEMO if p.name == DEMO_FOLDER else p.name, "freetoken") for p in paths]


def path_models(paths: list[str]) -> list[ModelEntry]:
    """Each path; a folder that is no model itself stands for the models directly inside it."""
    entries = []
    for given in paths:
        path = Path(given).expanduser()
        folder = path.is_dir() and not is_model(path)
        if inner := sorted(p for p in path.iterdir() if is_model(p)) if folder else []:
            entries += [inspect_path(p, str(Path(given) / p.name), "path") for p in inner]
        else:
            entries.append(inspect_path(path, given, "path"))
    return entries


def list_models(paths: list[str] | None = None) -> list[ModelEntry]:
    """The given paths; without any, the Hugging Face cache and FreeToken's own models."""
    return path_models(paths) if paths else hf_cache_models() + own_models()


def remove_own_model(entry: ModelEntry) -> None:
    """Delete one of FreeToken's own models (all shards of a GGUF); a link is removed, not followed."""
    root = models_dir().resolve()
    if entry.source != "freetoken" or entry.path.parent.resolve() != root:
        raise FreeTokenError(f"{entry.path}: not under {root}; FreeToken removes only its own models")
    for path in gguf_files(entry.path) if entry.format == "gguf" else [entry.path]:
        try:
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                shutil.rmtree(path)
        except OSError as exc:
            raise FreeTokenError(f"{path}: cannot remove ({exc.strerror or exc})") from None
