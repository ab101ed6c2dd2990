"""Host expert pool: every expert of every MoE layer in host memory, the source of truth.

Bank layout per MoE layer (the layout the offload cache copies from):
  gate_up [E, 2I, H]  rows [0, I) are the gate projection, rows [I, 2I) the up projection
  down    [E, H, I]
A layer kept as stored (`stored`: its two banks' codecs, e.g. Q8_0 from a GGUF file) holds uint8 banks
[E, 2I, row_bytes(H)] and [E, H, row_bytes(I)] of the codec's blocks instead; every other layer holds
`dtype` banks. Experts stay outermost and contiguous either way.

Families whose experts carry biases (gpt-oss) hold them beside the banks, fp32 and never quantized:
  gate_up_bias [E, 2I] (gate half first), down_bias [E, H]
and `fn` says what an expert computes between its projections (expert_fn.py).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from freetoken.codecs import Codec
from freetoken.errors import FreeTokenError
from freetoken.formats.tensor_names import BIAS_PARTS, ExpertTensor
from freetoken.runtime.moe.expert_fn import SILU, ExpertFn

# Banks in transparent huge pages (512 times fewer TLB entries for the CPU kernel's streams). On a
# 2-core host the expert kernel read 24.9 GB/s from them against 20.3 from 4 KiB pages (a decode step
# 23.7 ms against 25.8); a 16-core host measured the same in either kind (benchmarks/cpu_kernel_sweep.py).
HUGE_PAGES = True


def expert_tensor_shape(target: ExpertTensor, e: int, h: int, i: int) -> tuple[int, ...]:
    """The shape a checkpoint tensor for `target` must have: one expert's part, or a fused bank (in the
    checkpoint's layout: gpt-oss's banks are [E, in, out])."""
    biases = {"gate_up_bias": (2 * i,), "gate_bias": (i,), "up_bias": (i,), "down_bias": (h,)}
    per_expert = {"gate": (i, h), "up": (i, h), "down": (h, i), **biases}
    if target.expert is not None:
        return per_expert[target.part]
    if target.layout == "interleaved_in_out":
        return {"gate_up": (e, h, 2 * i), "down": (e, i, h), **{k: (e, *v) for k, v in biases.items()}}[
            target.part
        ]
    fused = {"gate_up": (e, 2 * i, h), "gate": (e, i, h), "up": (e, i, h), "down": (e, h, i)}
    return fused.get(target.part) or (e, *biases[target.part])


def gate_first(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Gate and up entries alternating along `dim` (gpt-oss's layout) -> the gate entries, then the up."""
    halves = []
    for start in (0, 1):
        index: list[slice] = [slice(None)] * t.dim()
        index[dim] = slice(start, None, 2)
        halves.append(t[tuple(index)])
    return torch.cat(halves, dim=dim)


def to_pool_layout(target: ExpertTensor, tensor: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """A checkpoint tensor in the pool's layout: gpt-oss's [E, H, 2I] gate_up with gate and up columns
    alternating becomes [E, 2I, H] with the gate rows first; its [E, I, H] down becomes [E, H, I]; its
    alternating gate_up bias, gate half first."""
    if target.layout != "interleaved_in_out":
        return tensor
    t = torch.as_tensor(tensor)
    if target.part == "gate_up":
        return gate_first(t.transpose(-1, -2), dim=-2)
    if target.part == "gate_up_bias":
        return gate_first(t, dim=-1)
    return t.transpose(-1, -2) if target.part == "down" else t


def stored_rows_in_pool_layout(target: ExpertTensor, rows: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A gpt-oss bank kept as codec rows ([E, out, row bytes], as its MXFP4 blocks are stored): the gate_up
    bank's alternating gate and up rows, gate rows first; the down bank as it is."""
    t = torch.as_tensor(rows)
    return gate_first(t, dim=1) if target.part == "gate_up" else t


@dataclass
class HostExpertPool:
    layers: tuple[int, ...]
    num_experts: int
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype
    gate_up: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [E, 2I, H]
    down: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [E, H, I]
    _filled: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, repr=False)  # -> [E] bool
    pinned: bool = False  # page-locked by pin()
    stored: dict[int, tuple[Codec, Codec]] = field(default_factory=dict)  # layer -> (gate_up, down) codecs
    fn: ExpertFn = SILU
    gate_up_bias: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [E, 2I] fp32
    down_bias: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [E, H] fp32

    @classmethod
    def allocate(
        cls,
        layers: tuple[int, ...],
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        huge_pages: bool = HUGE_PAGES,
        stored: dict[int, tuple[Codec, Codec]] | None = None,
        fn: ExpertFn = SILU,
        biased: bool = False,
    ) -> HostExpertPool:
        """Banks start on 4096-byte boundaries, so direct I/O can read straight into them; with
        `huge_pages`, on 2 MiB boundaries in transparent huge pages. `stored`: layers whose banks hold
        codec blocks (uint8) rather than `dtype` values. `fn`: the experts' function; `biased`: the experts
        carry gate/up and down biases (to be written like the banks)."""
        from freetoken.formats.ftw import aligned_empty

        pool = cls(
            layers, num_experts, hidden_size, intermediate_size, dtype, stored=dict(stored or {}), fn=fn
        )
        e, h, i = num_experts, hidden_size, intermediate_size
        for layer in layers:
            if layer in pool.stored:
                gu, dn = pool.stored[layer]
                gu_shape, dn_shape = (e, 2 * i, gu.row_bytes(h)), (e, h, dn.row_bytes(i))
                pool.gate_up[layer] = aligned_empty(gu_shape, torch.uint8, huge=huge_pages)
                pool.down[layer] = aligned_empty(dn_shape, torch.uint8, huge=huge_pages)
            else:
                pool.gate_up[layer] = aligned_empty((e, 2 * i, h), dtype, huge=huge_pages)
                pool.down[layer] = aligned_empty((e, h, i), dtype, huge=huge_pages)
            for part in ("gate", "up", "down"):
                pool._filled[(layer, part)] = torch.zeros(e, dtype=torch.bool)
            if biased:
                pool.gate_up_bias[layer] = torch.zeros(e, 2 * i)
                pool.down_bias[layer] = torch.zeros(e, h)
                for part in ("gate_bias", "up_bias", "down_bias"):
                    pool._filled[(layer, part)] = torch.zeros(e, dtype=torch.bool)
        return pool

    @property
    def biased(self) -> bool:
        return bool(self.gate_up_bias)

    @property
    def nbytes(self) -> int:
        banks = (self.gate_up, self.down, self.gate_up_bias, self.down_bias)
        return sum(t.numel() * t.element_size() for bank in banks for t in bank.values())

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert as the pool holds it (the largest layer's, where layers differ): what an
        expert slot on the device holds, and what a fetch or a CPU pass reads."""
        return max(self.layer_expert_nbytes(layer) for layer in self.layers) if self.layers else 0

    def layer_expert_nbytes(self, layer: int) -> int:
        """Bytes of one expert of `layer`'s banks (codec blocks as stored, or `dtype` values)."""
        h, i = self.hidden_size, self.intermediate_size
        if layer in self.stored:
            gu, dn = self.stored[layer]
            return gu.tensor_bytes(2 * i, h) + dn.tensor_bytes(h, i)
        return 3 * h * i * torch.empty(0, dtype=self.dtype).element_size()

    def slot_codecs(self) -> dict[int, tuple[Codec, Codec]] | None:
        """Each layer's (gate_up, down) codec pair as stored, which slots then hold too (layers may differ:
        slots are as long as the largest pair needs); None when the banks hold `dtype` values. Slots hold
        one kind: codec blocks for every layer, or values for every layer."""
        if not self.stored:
            return None
        values = [layer for layer in self.layers if layer not in self.stored]
        if values:
            raise FreeTokenError(
                f"expert slots need every MoE layer's experts as stored or none: layers {values[:4]} hold "
                f"{self.dtype} values, the others codec blocks"
            )
        return {layer: self.stored[layer] for layer in self.layers}

    def codec_names(self, layer: int) -> tuple[str, str]:
        """(gate_up, down) codec names of a layer's banks: the stored codecs, or the dtype's."""
        if layer in self.stored:
            gu, dn = self.stored[layer]
            return gu.name, dn.name
        names = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
        name = names.get(self.dtype, str(self.dtype))
        return name, name

    def describe(self) -> dict[str, object]:
        """What `--json` reports: the bytes of routed-expert weights held and the codecs they are in."""
        names = sorted({name for layer in self.layers for name in self.codec_names(layer)})
        return {"bytes": self.nbytes, "dtypes": names}

    def expected_shape(self, target: ExpertTensor) -> tuple[int, ...]:
        return expert_tensor_shape(target, self.num_experts, self.hidden_size, self.intermediate_size)

    def _destination(self, target: ExpertTensor) -> torch.Tensor:
        i = self.intermediate_size
        if target.part in BIAS_PARTS:
            bank = (self.down_bias if target.part == "down_bias" else self.gate_up_bias)[target.layer]
            cols = {"gate_bias": slice(0, i), "up_bias": slice(i, 2 * i)}.get(target.part, slice(None))
            return bank[:, cols] if target.expert is None else bank[target.expert, cols]
        if target.expert is None:
            halves = {"gate": slice(0, i), "up": slice(i, 2 * i)}
            if target.part in halves:
                return self.gate_up[target.layer][:, halves[target.part]]
            return self.gate_up[target.layer] if target.part == "gate_up" else self.down[target.layer]
        if target.part == "down":
            return self.down[target.layer][target.expert]
        rows = slice(0, i) if target.part == "gate" else slice(i, 2 * i)
        return self.gate_up[target.layer][target.expert, rows]

    def _check_target(self, target: ExpertTensor, name: str) -> None:
        if target.layer not in self.gate_up:
            raise FreeTokenError(f"unexpected tensor {name}: layer {target.layer} has no experts")
        if target.part in BIAS_PARTS and not self.biased:
            raise FreeTokenError(f"unexpected tensor {name}: this model's experts have no biases")
        if target.expert is not None and not 0 <= target.expert < self.num_experts:
            raise FreeTokenError(f"unexpected tensor {name}: expert {target.expert} >= {self.num_experts}")

    def _holds_blocks(self, target: ExpertTensor) -> bool:
        return target.layer in self.stored and target.part not in BIAS_PARTS

    def _stored_codec(self, target: ExpertTensor) -> Codec:
        gu, dn = self.stored[target.layer]
        return dn if target.part == "down" else gu

    def _block_shape(self, target: ExpertTensor, expected: tuple[int, ...]) -> tuple[int, ...]:
        """`expected` (values, the pool's layout) as codec blocks of the layer's codec: the last dim bytes."""
        return (*expected[:-1], self._stored_codec(target).row_bytes(expected[-1]))

    def plain_destination(
        self, target: ExpertTensor, name: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor | None:
        """Where a checkpoint tensor of `shape` and `dtype` lands with no conversion (already in the pool's
        layout and dtype, or codec blocks of a layer kept as stored): its view of the banks, which the
        caller fills in place and then marks (mark_written); None where write() has to convert it."""
        self._check_target(target, name)
        blocks = self._holds_blocks(target)
        if target.layout != "rows" or dtype != (torch.uint8 if blocks else self.dtype):
            return None
        expected = self.expected_shape(target)
        if blocks:
            expected = self._block_shape(target, expected)
        if tuple(shape) != expected:
            raise FreeTokenError(f"tensor {name} has shape {list(shape)}, expected {list(expected)}")
        return self._destination(target)

    def write(self, target: ExpertTensor, name: str, tensor: torch.Tensor | np.ndarray) -> None:
        """Copy one checkpoint tensor into its place in the banks (converting dtype on the way); codec
        blocks may come as a numpy array (a read-only view of a file)."""
        self._check_target(target, name)
        expected = self.expected_shape(target)
        blocks = self._holds_blocks(target)
        if target.layout != "rows" and blocks:  # codec rows come [E, out, bytes]: gate/up rows alternate
            tensor = stored_rows_in_pool_layout(target, tensor)
            expected = self.expected_shape(replace(target, layout="rows"))
        elif target.layout != "rows":  # the checkpoint's layout first, then the pool's
            if tuple(tensor.shape) != expected:
                raise FreeTokenError(
                    f"tensor {name} has shape {list(tensor.shape)}, expected {list(expected)}"
                )
            tensor = to_pool_layout(target, tensor)
            expected = tuple(tensor.shape)
        if blocks:  # codec blocks: the last dim is bytes
            expected = self._block_shape(target, expected)
            if tensor.dtype not in (torch.uint8, np.uint8):
                kept = f"layer {target.layer} keeps {self._stored_codec(target).name} blocks"
                raise FreeTokenError(f"tensor {name}: {kept}, got {tensor.dtype}")
        if tuple(tensor.shape) != expected:
            raise FreeTokenError(f"tensor {name} has shape {list(tensor.shape)}, expected {list(expected)}")
        if isinstance(tensor, np.ndarray):
            np.copyto(self._destination(target).numpy(), tensor)
        else:
            self._destination(target).copy_(tensor)
        self.mark_written(target)

    def mark_written(self, target: ExpertTensor) -> None:
        """Record `target`'s experts and parts as written."""
        fused = {"gate_up": ("gate", "up"), "gate_up_bias": ("gate_bias", "up_bias")}
        parts = fused.get(target.part, (target.part,))
        for part in parts:
            mask = self._filled[(target.layer, part)]
            if target.expert is None:
                mask.fill_(True)
            else:
                mask[target.expert] = True

    def mark_filled(self) -> None:
        """Declare every expert written (for banks filled directly, not tensor by tensor)."""
        for mask in self._filled.values():
            mask.fill_(True)

    def missing(self) -> list[str]:
        """Describe every (layer, expert, part) never written, as '<layer>.<expert>.<part>'."""
        out = []
        for (layer, part), mask in self._filled.items():
            out.extend(f"layer {layer} expert {e} {part}" for e in (~mask).nonzero().flatten().tolist())
        return out

    def pin(self) -> None:
        """Page-lock the filled banks in place (cudaHostRegister), so fills are true async DMA.

        Called once after loading, never before: pinning first would make every write go to locked
        pages and would hold the memory before the checkpoint is known to be whole.
        """
        if self.pinned:
            return
        cudart = torch.cuda.cudart()
        registered: list[int] = []
        for bank in (self.gate_up, self.down):  # the biases are read from their device copies
            for layer, tensor in bank.items():
                code = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
                if int(code) == 0:
                    registered.append(tensor.data_ptr())
                else:  # registration refused (limits): fall back to a pinned copy
                    bank[layer] = tensor.pin_memory()
        # Not tensor.is_pinned(): torch asks about the storage's first byte, and an aligned bank is a view
        # that starts past it, so a registered bank reads as unpinned there.
        self.pinned = True
        # Unregister before the banks are freed: a stale registration over reused addresses would let
        # later copies DMA from pages that are no longer these. Weakref callbacks run before the pool's
        # attributes are cleared, so the banks are still alive then.
        weakref.finalize(self, _unregister, registered)


def _unregister(pointers: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for pointer in pointers:
        cudart.cudaHostUnregister(pointer)
