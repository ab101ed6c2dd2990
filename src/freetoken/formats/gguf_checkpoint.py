"""A GGUF file (or a set of `-00001-of-0000N.gguf` shards) seen as a checkpoint with HF tensor names.

Tensors are zero-copy memmaps until read; reading dequantises with the `gguf` package (every type it
can dequantise) to float32. ggml orders dimensions innermost first: numpy shapes are reversed `ne`.
"""

from __future__ import annotations

import re
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from freetoken.codecs import Codec, codec_for_ggml
from freetoken.errors import FreeTokenError
from freetoken.formats import gguf_deepseek4, gguf_kimi, gguf_qwen_hybrid
from freetoken.formats.ftw import populate_mapping
from freetoken.formats.gguf_header import TensorInfo, read_header
from freetoken.formats.range_read import Piece, RangeReader, byte_views

SHARD = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf$")
# read as they are (I32: DeepSeek-V4's token-id routing tables)
PLAIN_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I32": torch.int32}

# GGUF name -> HF name, per layer ({i}); experts are whole-layer banks ([E, I, H] / [E, H, I]).
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",  # newer files: [E, 2I, H], gate rows first
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # glm4moe: its post-attention norm's name, q/k/v biases, the router's correction bias, shared experts
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    # gpt-oss: sinks, the output projection's and the router's biases, the experts' biases
    "attn_sinks.weight": "self_attn.sinks",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate_inp.bias": "mlp.gate.bias",
    "ffn_gate_exps.bias": "mlp.experts.gate_proj_bias",
    "ffn_up_exps.bias": "mlp.experts.up_proj_bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
    # deepseek2 (latent attention): q through a low rank, the latent's projections; newer files split
    # kv_b_proj into attn_k_b [H, r, dn] and attn_v_b [H, dv, r] (read back as one, below)
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_k_b.weight": "self_attn.k_b_proj.weight",
    "attn_v_b.weight": "self_attn.v_b_proj.weight",
    # glm-dsa (GLM-5): the sparse attention's indexer
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
    "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
    "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight",
}
SPLIT_KV_B = ("self_attn.k_b_proj.weight", "self_attn.v_b_proj.weight")
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
_ONE_EXPERT = re.compile(r"ffn_(gate|up|down)\.(\d+)\.weight")  # older Mixtral files: expert by expert
# archs whose q/k rows llama.cpp's converter permuted for its interleaved rope (HF's pairs are halves apart)
ROPE_PERMUTED = ("llama",)
# per arch: its own layer names over LAYER_NAMES, and what reading its converted tensors undoes
# (a module with LAYER_NAMES, converted(name), from_file(name, tensor, fields), hf_shape(name, shape))
CONVERSIONS = {
    arch: module for module in (gguf_qwen_hybrid, gguf_kimi, gguf_deepseek4) for arch in module.ARCHS
}
ARCH_LAYER_NAMES = {arch: {**LAYER_NAMES, **module.LAYER_NAMES} for arch, module in CONVERSIONS.items()}


def hf_name(name: str, arch: str = "") -> str | None:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    arch_globals = getattr(CONVERSIONS.get(arch), "GLOBAL_NAMES", {})
    if name in arch_globals:
        return arch_globals[name]
    match = _LAYER.fullmatch(name)
    names = ARCH_LAYER_NAMES.get(arch, LAYER_NAMES)
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}"
    one = _ONE_EXPERT.fullmatch(match.group(2)) if match else None
    if match and one:
        return f"model.layers.{match.group(1)}.mlp.experts.{one.group(2)}.{one.group(1)}_proj.weight"
    return None


Join = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """Per head: k_b transposed back, then v_b, as transformers' kv_b_proj."""
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1)


def file_view(array: np.ndarray) -> torch.Tensor:
    """A tensor over `array`'s memory with no copy, also where that memory is a read-only map of a file
    (torch warns that it cannot mark such a tensor read-only; the readers here only copy out of it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def unpermute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, rows (pair i, half j) back to (half j, pair i)."""
    rows, rest = weight.shape[0], weight.shape[1:]
    return weight.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def check_part(shard: Path, fields: dict[str, Any], index: int, parts: int) -> None:
    """A part of a split file says it is part index + 1 of `parts` (`split.no`, `split.count`), or it is
    a part of another split."""
    no, count = fields.get("split.no"), fields.get("split.count")
    if parts > 1 and no is not None and count is not None and (int(no), int(count)) != (index, parts):
        raise FreeTokenError(
            f"{shard}: its metadata makes it part {int(no) + 1} of {int(count)}, not part {index + 1} of "
            f"{parts} (a part of another split?)"
        )


def shard_paths(path: Path) -> list[Path]:
    match = SHARD.match(path.name)
    if not match:
        return [path]
    stem, count = match.group(1), int(match.group(3))
    paths = [path.with_name(f"{stem}-{n:05d}-of-{count:05d}.gguf") for n in range(1, count + 1)]
    for p in paths:
        if not p.exists():
            raise FreeTokenError(f"{path}: shard {p.name} is missing")
    return paths


class GgufTensor:
    """One tensor of a mapped GGUF file: its GGUF name, type, bytes, and `data`, a read-only uint8 view
    [*numpy shape[:-1], row bytes] of the file (what gguf.quants.dequantize takes for every type)."""

    def __init__(self, info: TensorInfo, file: np.memmap, path: Path) -> None:
        from gguf.constants import GGMLQuantizationType

        self.info, self._file, self.path = info, file, path
        self.name, self.n_bytes = info.name, info.n_bytes
        self.tensor_type = GGMLQuantizationType(info.ggml_type)

    @property
    def shape(self) -> tuple[int, ...]:
        """ne: dims innermost first (as the gguf package's tensors give them)."""
        return self.info.ne

    @property
    def data(self) -> np.ndarray:
        """Mapped in at once (populate_mapping): a reader copies or dequantises all of it next."""
        raw = self._file[self.info.offset : self.info.offset + self.n_bytes]
        populate_mapping(raw.ctypes.data, self.n_bytes)
        rows = int(np.prod(self.info.ne[1:])) if len(self.info.ne) > 1 else 1
        return raw.reshape(*tuple(reversed(self.info.ne))[:-1], self.n_bytes // max(rows, 1))


class GgufCheckpoint:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.model_dir = self.path
        self.fields: dict[str, Any] = {}
        self.tensors: dict[str, GgufTensor] = {}
        self.unknown: list[str] = []
        self._files: list[np.memmap] = []
        # buffered: a file read again comes from the page cache; tensor offsets are 32-byte aligned at best
        self.reader = RangeReader(direct=False)
        shards, counted = shard_paths(self.path), 0
        for index, shard in enumerate(shards):
            try:
                header = read_header(shard)
                file = np.memmap(shard, dtype=np.uint8, mode="r")
            except (OSError, ValueError, KeyError, struct.error) as exc:
                raise FreeTokenError(f"{shard}: not a readable GGUF file ({exc})") from None
            check_part(shard, header.fields, index, len(shards))
            counted += len(header.tensors)
            self._files.append(file)
            self.fields = {**header.fields, **self.fields}  # the first shard's value wins
            arch = str(self.get("general.architecture", ""))
            for info in header.tensors:
                if self._multi_token_block(info.name):  # next-token-prediction blocks: not read
                    continue
                name = hf_name(info.name, arch)
                if name is None:
                    self.unknown.append(info.name)
                else:
                    self.tensors[name] = GgufTensor(info, file, shard)
        if self.unknown:
            raise FreeTokenError(f"{self.path}: unknown tensors {self.unknown[:5]}")
        expected = self.get("split.tensors.count")
        if len(shards) > 1 and expected is not None and int(expected) != counted:
            raise FreeTokenError(
                f"{self.path}: its {len(shards)} parts hold {counted} tensors, the split says "
                f"{int(expected)} (a part from another file?)"
            )
        self.conversion = CONVERSIONS.get(arch)  # what reading undoes of the converter's changes, if any
        # one HF tensor from two of the file's: name -> (the two parts' names, what joins them)
        self.joined: dict[str, tuple[tuple[str, str], Join]] = {}
        for name in self.tensors:
            if name.endswith(SPLIT_KV_B[0]):  # latent attention's kv_b_proj from its per-head halves
                whole = name.replace(SPLIT_KV_B[0], "self_attn.kv_b_proj.weight")
                self.joined[whole] = ((name, name.replace(*SPLIT_KV_B)), _join_kv_b)
            if arch == "qwen3next" and name.endswith(gguf_qwen_hybrid.QKV):  # its fused q, k, v, z
                parts = (name, name.replace(gguf_qwen_hybrid.QKV, gguf_qwen_hybrid.Z))
                self.joined[name.replace(gguf_qwen_hybrid.QKV, gguf_qwen_hybrid.QKVZ)] = (
                    parts,
                    lambda qkv, z: gguf_qwen_hybrid.join_qkvz(qkv, z, self.fields),
                )

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def _multi_token_block(self, name: str) -> bool:
        """Whether `name` belongs to the multi-token-prediction blocks some files append after the trunk
        (`{arch}.nextn_predict_layers` of the `{arch}.block_count` blocks)."""
        arch = self.get("general.architecture")
        extra = int(self.get(f"{arch}.nextn_predict_layers", 0) or 0)
        match = _LAYER.fullmatch(name)
        return bool(extra and match) and int(match.group(1)) >= int(self.get(f"{arch}.block_count")) - extra

    def names(self) -> list[str]:
        parts = {part for pair, _ in self.joined.values() for part in pair}
        return [name for name in self.tensors if name not in parts] + list(self.joined)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.joined:
            first, second = (self.shape(part) for part in self.joined[name][0])
            if len(first) == 3:  # kv_b: [H, r, dn] and [H, dv, r] -> [H · (dn + dv), r]
                return first[0] * (first[2] + second[1]), first[1]
            return first[0] + second[0], first[1]  # in_proj_qkvz: the rows of both
        shape = tuple(reversed(self.tensors[name].info.ne))
        return self.conversion.hf_shape(name, shape) if self.conversion is not None else shape

    def nbytes(self, name: str) -> int:
        if name in self.joined:
            return sum(self.nbytes(part) for part in self.joined[name][0])
        return int(self.tensors[name].n_bytes)

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def codec(self, name: str) -> Codec:
        """The tensor's codec; an unsupported type names the tensor, the type and the supported ones."""
        tensor = self.tensors[name]
        return codec_for_ggml(int(tensor.tensor_type), f"{self.path}: tensor {tensor.name}")

    def _stored_shape(self, name: str) -> tuple[int, ...]:
        """[*HF shape[:-1], row bytes] of a tensor kept as codec blocks; a row of the wrong size names the
        tensor (a truncated block array)."""
        tensor, shape = self.tensors[name], self.shape(name)
        width = self.codec(name).row_bytes(shape[-1])
        if tensor.n_bytes != int(np.prod(shape[:-1])) * width:
            raise FreeTokenError(
                f"{self.path}: tensor {tensor.name} holds {tensor.n_bytes} bytes, expected "
                f"{int(np.prod(shape[:-1])) * width} for {list(shape)} in {self.codec(name).name}"
            )
        return (*shape[:-1], width)

    def read_stored(self, name: str) -> np.ndarray:
        """The tensor's blocks as stored, uint8 [*HF shape[:-1], row bytes]: a read-only view of the file
        (the pool copies it once)."""
        shape = self._stored_shape(name)
        return np.asarray(self.tensors[name].data).view(np.uint8).reshape(shape)

    def plain_form(self, name: str, as_stored: bool) -> tuple[tuple[int, ...], torch.dtype] | None:
        """The shape and dtype of the tensor's bytes where reading them needs no conversion: codec blocks
        kept as stored (`as_stored`: [*HF shape[:-1], row bytes] uint8), or a BF16 / F16 / F32 tensor whose
        rows the file does not permute (its HF shape and dtype); None where reading converts them."""
        if name in self.joined:
            return None
        if as_stored:
            return self._stored_shape(name), torch.uint8
        dtype = PLAIN_DTYPES.get(self.tensors[name].tensor_type.name)
        if dtype is None or self._permuted_heads(name) or self._converted(name) is not None:
            return None
        return self.shape(name), dtype

    def read_into(self, name: str, dest: torch.Tensor) -> None:
        """The tensor's bytes, as the file holds them, into `dest`: a host tensor of plain_form's shape and
        dtype, contiguous or a strided view (each contiguous block in turn), read by parallel requests."""
        tensor = self.tensors[name]
        if dest.numel() * dest.element_size() != tensor.n_bytes:
            raise ValueError(f"destination for {tensor.name} does not match its {tensor.n_bytes} bytes")
        offset, pieces = tensor.info.offset, []
        for view in byte_views(dest):
            pieces.append(Piece(tensor.path, offset, view))
            offset += len(view)
        self.reader.read(pieces)

    def read(self, name: str) -> torch.Tensor:
        """In the HF shape: BF16, F16 and I32 tensors as they are stored (a read-only view of the file where
        no row permutation applies: the caller copies it once, into its own dtype), other types
        dequantised to float32."""

        if name in self.joined:
            (first, second), join = self.joined[name]
            return join(self.read(first), self.read(second)).reshape(self.shape(name))
        undo = self._converted(name)
        if undo is not None:
            return undo(name, self._read_file_values(name), self.fields)
        return self._read_file_values(name)

    def _converted(self, name: str) -> Any:
        """The function that undoes the converter's change to `name` (CONVERSIONS), or None."""
        conversion = self.conversion
        return conversion.from_file if conversion is not None and conversion.converted(name) else None

    def _read_file_values(self, name: str) -> torch.Tensor:
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        widths = {"BF16": (np.int16, torch.bfloat16), "F16": (np.float16, torch.float16)}
        widths["I32"] = (np.int32, torch.int32)
        widen = widths.get(tensor.tensor_type.name)
        if widen is not None:
            raw = np.asarray(tensor.data).view(np.uint8).view(widen[0]).reshape(self.shape(name))
            heads = self._permuted_heads(name)
            if heads:
                raw = unpermute_rope_rows(raw, heads)
            return file_view(raw).view(widen[1])
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise FreeTokenError(
                f"{self.path}: tensor {tensor.name} has type {tensor.tensor_type.name}, "
                "which the gguf package cannot dequantise"
            ) from None
        array = np.ascontiguousarray(values, dtype=np.float32).reshape(self.shape(name))
        heads = self._permuted_heads(name)
        if heads:
            array = unpermute_rope_rows(array, heads)
        if not array.flags.writeable:  # F32 tensors come back as views of the read-only memmap
            array = array.copy()
        return torch.from_numpy(array)

    def _permuted_heads(self, name: str) -> int:
        """The heads of a q/k projection whose rows the file holds permuted (ROPE_PERMUTED), else 0."""
        arch = self.get("general.architecture")
        if arch not in ROPE_PERMUTED:
            return 0
        if name.endswith("self_attn.q_proj.weight"):
            return int(self.get(f"{arch}.attention.head_count"))
        if name.endswith("self_attn.k_proj.weight"):
            key = f"{arch}.attention.head_count_kv"
            return int(self.get(key, self.get(f"{arch}.attention.head_count")))
        return 0

    def close(self) -> None:
        self._files.clear()

    def __enter__(self) -> GgufCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
