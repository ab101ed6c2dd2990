"""Fill expert slots from the host pool with one Triton launch that reads the page-locked host banks in
place through unified virtual addressing (UVA), driven by a plan that lives on the device: no host sync,
no data-dependent shape or address on the host side (graph-capturable).

A device-side LRU writes, per MoE layer step, `plan [P, 2] int32` rows (expert, slot) and `count [1]
int32`; rows [0, count) are live, rows past it may hold -1. `fill_slots` copies expert plan[r, 0] of the
layer's host banks (gate_up [E, 2I, H], down [E, H, I]) into slot plan[r, 1] of the device banks
(gate_up [S, 2I, H], down [S, H, I]) for every live row. A device bank may be a view of longer slots (a
slot stride past the expert's length, as slot_bank.py gives layers of shorter codec rows): each slot's
expert is still one contiguous run at the slot's start. Rows with an entry outside [0, E) x [0, S)
(-1 padding included) are skipped, so no plan can make the graph read or write out of the banks. Slots
within one plan must be distinct (the LRU's invariant; two rows into one slot race).

The grid is (P, chunks) from shapes only (expert_fill_triton.py): program (r, c) returns at once when
r >= count[0] (read on the device) or row r is padding, else copies chunk c of the expert: chunks
[0, gu_chunks) cover its gate_up run, the rest its down run, each run byte-contiguous in its bank.

Word size: each bank pair (host and device) is copied as integer words, the widest of 8, 4, 2, 1 bytes
that divides one expert's run in bytes and both banks' addresses. Real models get int64 words (even
H and I, and bank addresses aligned to at least 16 bytes: torch's CUDA allocator gives 256 or more, the
pool's aligned_empty 4096); odd shapes or misaligned views fall back to narrower words, down to the
element size. Copying integer words is bit-exact for any dtype (NaN payloads included).

On CUDA the source banks are CPU tensors that must be page-locked (HostExpertPool.pin's cudaHostRegister,
or pin_memory()); with unified addressing either is mapped for every device, flags 0 included. Triton's
launcher resolves each pointer argument with cuPointerGetAttribute(DEVICE_POINTER), which succeeds for
such memory and refuses pageable memory with a ValueError ("cannot be accessed from Triton (cpu
tensor?)"), at launch or at capture, not at replay. Under TRITON_INTERPRET=1 (the test suite
without CUDA) the same kernel body runs on CPU banks; elsewhere `fill_slots` falls back to
`fill_slots_reference`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch

from freetoken.runtime.triton_support import kernel_runs_on

MAX_GRID_Y = 65535  # CUDA's limit on the grid's second dimension: chunks per expert
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@dataclass(frozen=True)
class FillBlocks:
    """Work per program. Untuned guesses until benchmarks/expert_fill.py --sweep has run on a GPU."""

    block: int = 4096  # words per load and store (a power of two): 32 KiB in int64 words
    iters: int = 4  # load-store steps per program, so a program copies block * iters words of one run
    num_warps: int = 8

    def __post_init__(self) -> None:
        if self.block < 1 or self.block & (self.block - 1):
            raise ValueError(f"block must be a power of two, not {self.block}")
        if self.iters < 1 or self.num_warps < 1:
            raise ValueError(f"iters and num_warps must be positive, not {self.iters}, {self.num_warps}")

    @property
    def chunk(self) -> int:
        """Words per program."""
        return self.block * self.iters


DEFAULT_FILL_BLOCKS = FillBlocks()


@functools.cache
def _body() -> tuple[ModuleType, bool]:
    """(the kernel module, whether Triton's interpreter runs it)."""
    from triton.runtime.interpreter import InterpretedFunction

    from freetoken.runtime.moe.kernels import expert_fill_triton as body

    return body, isinstance(body.fill_slots_kernel, InterpretedFunction)


def fill_kernel_available(device: torch.device | str) -> bool:
    """Whether `fill_slots` runs the Triton kernel for destination banks on `device`: CUDA ones, or CPU
    ones under TRITON_INTERPRET=1 (set before Triton is first imported)."""
    return kernel_runs_on(_body, device)


class _HostWords:
    """A host bank as a Triton pointer argument: Triton takes any object with `data_ptr()` and `dtype` as
    a pointer. Triton 3.6 would take the CPU tensor itself (its specialiser reads only those two, and the
    launcher maps the address with cuPointerGetAttribute), but nothing in Triton promises not to look at
    a tensor's device, so the launch passes an object that has none. It holds the tensor, so the memory
    outlives the launch."""

    __slots__ = ("dtype", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.dtype = tensor.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


def _aligned(bank: torch.Tensor, size: int) -> bool:
    """The address (what the kernel's loads need) and the storage offset (what view(dtype) checks)."""
    return bank.data_ptr() % size == 0 and bank.storage_offset() * bank.element_size() % size == 0


def _word_dtype(run_bytes: int, slot_bytes: int, *banks: torch.Tensor) -> torch.dtype:
    """The widest integer word dividing one expert's run, the destination's slot stride and every bank's
    address (see the module)."""
    for size, dtype in _WORDS:
        fits = run_bytes % size == 0 and slot_bytes % size == 0
        if fits and all(_aligned(bank, size) for bank in banks):
            return dtype
    raise AssertionError("one-byte words always fit")


def _as_words(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(src [E, words], dst [S, words] with dst's slot stride): banks of one dtype and one row shape,
    as words; the first `run` words of each dst row are its slot's expert."""
    run = src.shape[1] * src.shape[2]  # elements of one expert
    size = src.element_size()
    word = _word_dtype(run * size, dst.stride(0) * size, src, dst)
    rows = dst.as_strided((dst.shape[0], run), (dst.stride(0), 1))
    return src.view(src.shape[0], run).view(word), rows.view(word)


def _check_bank(
    name: str, bank: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, slots: bool = False
) -> None:
    """`slots`: each row's expert contiguous, rows at least an expert apart (a view of longer slots)."""
    if tuple(bank.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(bank.shape)}, expected {shape}")
    if bank.dtype != dtype:
        raise ValueError(f"{name} is {bank.dtype}, not {dtype} as src_gate_up")
    run = shape[1] * shape[2]
    if slots and shape[0] > 0 and bank[0].is_contiguous() and bank.stride(0) >= run:
        return
    if not bank.is_contiguous():
        raise ValueError(f"{name} must be contiguous" + (" within each slot" if slots else ""))


def _check(
    plan: torch.Tensor,
    count: torch.Tensor,
    src_gate_up: torch.Tensor,
    src_down: torch.Tensor,
    dst_gate_up: torch.Tensor,
    dst_down: torch.Tensor,
) -> None:
    if plan.dim() != 2 or plan.shape[1] != 2 or plan.dtype != torch.int32 or not plan.is_contiguous():
        raise ValueError(
            f"plan must be a contiguous [P, 2] int32 tensor, not {tuple(plan.shape)} {plan.dtype}"
        )
    if tuple(count.shape) != (1,) or count.dtype != torch.int32:
        raise ValueError(f"count must be [1] int32, not {tuple(count.shape)} {count.dtype}")
    if src_gate_up.dim() != 3 or src_gate_up.shape[1] % 2:
        raise ValueError(f"src_gate_up must be [E, 2I, H], not {tuple(src_gate_up.shape)}")
    if dst_gate_up.dim() != 3:
        raise ValueError(f"dst_gate_up must be [S, 2I, H], not {tuple(dst_gate_up.shape)}")
    e, two_i, h = src_gate_up.shape
    s, dtype = dst_gate_up.shape[0], src_gate_up.dtype
    # codec blocks (uint8): rows are bytes, whose count the down bank itself says; values: [H, I]
    blocks = dtype == torch.uint8 and src_down.dim() == 3
    down_rows = tuple(src_down.shape[1:]) if blocks else (h, two_i // 2)
    _check_bank("src_gate_up", src_gate_up, (e, two_i, h), dtype)
    _check_bank("src_down", src_down, (e, *down_rows), dtype)
    _check_bank("dst_gate_up", dst_gate_up, (s, two_i, h), dtype, slots=True)
    _check_bank("dst_down", dst_down, (s, *down_rows), dtype, slots=True)
    device = dst_gate_up.device
    for name, t in (("plan", plan), ("count", count), ("dst_down", dst_down)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, not on dst_gate_up's {device}")
    for name, t in (("src_gate_up", src_gate_up), ("src_down", src_down)):
        if t.device.type != "cpu" and t.device != device:
            raise ValueError(f"{name} must be in host memory or on {device}, not on {t.device}")


def fill_slots(
    plan: torch.Tensor,
    count: torch.Tensor,
    src_gate_up: torch.Tensor,
    src_down: torch.Tensor,
    dst_gate_up: torch.Tensor,
    dst_down: torch.Tensor,
    blocks: FillBlocks = DEFAULT_FILL_BLOCKS,
) -> None:
    """Copy expert plan[r, 0] of the layer's host banks into slot plan[r, 1] of the device banks, for
    r < count[0].

    plan [P, 2] int32 (contiguous) and count [1] int32 on the device banks' device; src_gate_up
    [E, 2I, H] and src_down [E, H, I] in page-locked host memory (or on that device); dst_gate_up
    [S, 2I, H] and dst_down [S, H, I] (or views of longer slots, see the module); the host banks
    contiguous; all of one dtype. Enqueued on the current
    stream: the source must stay unchanged, and the slots unread, until it has run.
    """
    _check(plan, count, src_gate_up, src_down, dst_gate_up, dst_down)
    if not fill_kernel_available(dst_gate_up.device):
        _fill_rows(plan, count, src_gate_up, src_down, dst_gate_up, dst_down)
        return
    src_gu, dst_gu = _as_words(src_gate_up, dst_gate_up)
    src_dn, dst_dn = _as_words(src_down, dst_down)
    gu_words, dn_words = src_gu.shape[1], src_dn.shape[1]  # words of one expert in each bank
    gu_chunks = -(-gu_words // blocks.chunk)
    chunks = gu_chunks + -(-dn_words // blocks.chunk)
    if chunks > MAX_GRID_Y:
        raise ValueError(
            f"{chunks} chunks per expert exceed {MAX_GRID_Y}: raise blocks.block or blocks.iters"
        )
    if plan.shape[0] == 0 or chunks == 0:
        return
    body, interpreted = _body()
    if not interpreted:
        src_gu, src_dn = (_HostWords(t) if t.device.type == "cpu" else t for t in (src_gu, src_dn))
    body.fill_slots_kernel[(plan.shape[0], chunks)](
        plan, count, src_gu, dst_gu, src_dn, dst_dn, gu_words, dn_words, dst_gu.stride(0), dst_dn.stride(0),
        gu_chunks,
        src_gate_up.shape[0], dst_gate_up.shape[0],
        BLOCK=blocks.block, ITERS=blocks.iters, num_warps=blocks.num_warps,
    )  # fmt: skip


def fill_slots_reference(
    plan: torch.Tensor,
    count: torch.Tensor,
    src_gate_up: torch.Tensor,
    src_down: torch.Tensor,
    dst_gate_up: torch.Tensor,
    dst_down: torch.Tensor,
) -> None:
    """`fill_slots` in plain torch, row by row (reads count and the plan back: syncs on CUDA)."""
    _check(plan, count, src_gate_up, src_down, dst_gate_up, dst_down)
    _fill_rows(plan, count, src_gate_up, src_down, dst_gate_up, dst_down)


def _fill_rows(
    plan: torch.Tensor,
    count: torch.Tensor,
    src_gate_up: torch.Tensor,
    src_down: torch.Tensor,
    dst_gate_up: torch.Tensor,
    dst_down: torch.Tensor,
) -> None:
    e, s = src_gate_up.shape[0], dst_gate_up.shape[0]
    live = max(0, min(int(count[0]), plan.shape[0]))
    for expert, slot in plan[:live].tolist():
        if 0 <= expert < e and 0 <= slot < s:
            dst_gate_up[slot].copy_(src_gate_up[expert])
            dst_down[slot].copy_(src_down[expert])
