"""HF safetensors folder or GGUF file -> FTW folder (routed experts kept as a GGUF stores them, dequantised,
or quantized: `expert_dtype`). Assembled beside OUT in `.<name>.converting-<pid>`, fsynced, then
renamed into place: an interrupted convert leaves only that temporary folder, never something that looks
like a model. A failure removes it; one left by a killed convert is removed by the next convert into the
same folder (only when its process is gone)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from freetoken.errors import FreeTokenError
from freetoken.formats.ftw import DTYPES, SIDE_FILES, is_ftw
from freetoken.formats.ftw_writer import FtwWriter, fsync_path
from freetoken.formats.safetensors_dir import SafetensorsCheckpoint
from freetoken.runtime.json_keys import read_json
from freetoken.runtime.models import model_config_from

ProgressFn = Callable[[int, int], None]
STAGING = ".converting-"  # .<name>.converting-<pid>: the folder a convert assembles OUT in
# How routed experts are written: "stored" keeps a GGUF's quantized blocks as they are (other sources:
# the dtype), "dtype" dequantises them to --dtype, a codec name quantizes them into it
EXPERT_DTYPES = ("stored", "dtype", "Q8_0", "FP8")


@dataclass(frozen=True)
class ConvertResult:
    out: Path
    tensors: int
    shards: int
    nbytes: int
    seconds: float
    expert_dtypes: tuple[str, ...] = ()  # the routed experts' codecs (dtype names when not blocks)

    def as_dict(self) -> dict[str, object]:
        return {
            "out": str(self.out),
            "tensors": self.tensors,
            "shards": self.shards,
            "bytes": self.nbytes,
            "expert_dtypes": list(self.expert_dtypes),
            "seconds": round(self.seconds, 3),
            "GBps": round(self.nbytes / self.seconds / 1e9, 3),
        }


def convert_to_ftw(
    src: Path,
    out: Path,
    dtype: str = "bfloat16",
    shard_bytes: int = 4 << 30,
    force: bool = False,
    progress: ProgressFn | None = None,
    expert_dtype: str = "stored",
) -> ConvertResult:
    from freetoken.codecs import CODECS
    from freetoken.runtime.loading.weights import check_filled, fill_experts, plan_checkpoint, stored_codecs
    from freetoken.runtime.models import get_architecture
    from freetoken.runtime.moe.pool import HostExpertPool

    src, out = Path(src), Path(out)
    if dtype not in DTYPES:
        raise FreeTokenError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if expert_dtype not in EXPERT_DTYPES:
        raise FreeTokenError(f"--expert-dtype {expert_dtype!r}: choose one of {', '.join(EXPERT_DTYPES)}")
    gguf = src.is_file() and src.suffix == ".gguf"
    if not gguf and not src.is_dir():
        raise FreeTokenError(f"{src}: not a model folder or a .gguf file")
    if is_ftw(src):
        raise FreeTokenError(f"{src}: already an FTW folder")
    if out.exists() and not force:
        raise FreeTokenError(f"{out}: exists; pass --force to replace it")
    started = time.perf_counter()
    if gguf:
        from freetoken.formats.gguf_checkpoint import GgufCheckpoint
        from freetoken.formats.gguf_meta import config_dict

        source = GgufCheckpoint(src)
        config = config_dict(source)
    else:
        check_tokenizer(src)
        source = SafetensorsCheckpoint(src)
        config = read_json(src / "config.json")
    cfg = model_config_from(config, str(src if gguf else src / "config.json"))
    arch = get_architecture(cfg.architecture)
    with torch.device("meta"):
        model = arch.build_model(cfg)
    model.tie_weights()
    target = DTYPES[dtype]
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_folders(out.parent)
    tmp = out.with_name(f".{out.name}{STAGING}{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with source as ckpt:
            naming = arch.naming(gguf)
            plan = plan_checkpoint(model, cfg, ckpt, naming)
            total = sum(ckpt.nbytes(n) for n, _ in plan.dense) + sum(
                ckpt.nbytes(n) for items in plan.experts.values() for n, _ in items
            )
            done = 0
            writer = FtwWriter(tmp, shard_bytes, label=out)
            for name, _ in plan.dense:  # stored under the model's own names (FTW loads them as they are)
                writer.add(naming.canonical(name) or name, ckpt.read(name).to(target))
                done += ckpt.nbytes(name)
                if progress is not None:
                    progress(done, total)
            e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
            keep = stored_codecs(ckpt, plan, frozenset(CODECS)) if expert_dtype == "stored" else {}
            quantize_to = None if expert_dtype in ("stored", "dtype") else expert_dtype  # a codec name
            fill = torch.float32 if quantize_to else target  # quantized from fp32
            written: set[str] = set()
            for layer, items in plan.experts.items():
                stored = {layer: keep[layer]} if layer in keep else None
                bank = HostExpertPool.allocate(
                    (layer,), e, h, i, fill, stored=stored, biased=cfg.expert_bias
                )  # one layer at a time
                done += fill_experts(bank, ckpt, items)
                check_filled(bank, src)
                names = bank.codec_names(layer) if stored else (expert_dtype, expert_dtype)
                for kind, tensor, name in zip(
                    ("gate_up", "down"), (bank.gate_up[layer], bank.down[layer]), names, strict=True
                ):
                    codec = name if stored or quantize_to else None
                    if quantize_to and not stored:
                        tensor = torch.from_numpy(CODECS[codec].quantize(tensor.numpy(), f"experts.{layer}"))
                    writer.add(f"experts.{layer}.{kind}", tensor, kind=kind, layer=layer, codec=codec)
                    written.add(codec or dtype)
                for kind, biases in (("gate_up_bias", bank.gate_up_bias), ("down_bias", bank.down_bias)):
                    if layer in biases:  # fp32 as loaded, never quantized
                        writer.add(f"experts.{layer}.{kind}", biases[layer], kind=kind, layer=layer)
                del bank
                if progress is not None:
                    progress(done, total)
            manifest = writer.finish(dtype, cfg.architecture, config)
            if gguf:
                _write_gguf_side_files(ckpt, config, tmp)
        if not gguf:
            for name in SIDE_FILES:
                if (src / name).exists():
                    shutil.copyfile(src / name, tmp / name)
        fsync_path(tmp)
        _replace(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise FreeTokenError(f"{out}: conversion failed ({exc.strerror or exc})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    nbytes = sum(s["nbytes"] for s in manifest["shards"])
    seconds = time.perf_counter() - started
    return ConvertResult(
        out, len(manifest["tensors"]), len(manifest["shards"]), nbytes, seconds, tuple(sorted(written))
    )


def check_tokenizer(src: Path) -> None:
    """A folder converts only with a tokenizer that loads: `run` needs it, and finding out after the
    weights are written is too late."""
    from freetoken.runtime.text.tokenizer import Tokenizer

    if not (src / "tokenizer.json").is_file():
        raise FreeTokenError(f"{src}: no tokenizer.json; an FTW folder needs the model's tokenizer")
    Tokenizer.from_dir(src)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except (OverflowError, ValueError):
        return False
    return True


def remove_stale_folders(parent: Path) -> list[Path]:
    """Remove `.<name>.converting-<pid>` folders in `parent` whose process is gone (a killed convert);
    those of a live process stay. Returns what was removed."""
    removed = []
    for folder in parent.glob(f".*{STAGING}*"):
        pid = folder.name.rpartition(STAGING)[2]
        if folder.is_dir() and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _write_gguf_side_files(ckpt: object, config: dict, folder: Path) -> None:
    """config.json, tokenizer.json and tokenizer_config.json rebuilt from the GGUF's metadata."""
    import json

    from freetoken.formats.gguf_meta import build_tokenizer

    backend, tok_config = build_tokenizer(ckpt)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if "eos_token_id" in config:
        (folder / "generation_config.json").write_text(
            json.dumps({"eos_token_id": config["eos_token_id"]}) + "\n"
        )


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished folder into place; an existing OUT (with --force) goes only after that."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.replaced-{os.getpid()}")
        out.rename(old)
    try:
        tmp.rename(out)
    except OSError:
        if old is not None:
            old.rename(out)  # the model that was there stays
        raise
    fsync_path(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
