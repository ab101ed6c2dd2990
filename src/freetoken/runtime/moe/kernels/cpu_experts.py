"""CPU expert compute: the compiled kernel when it is there (bf16 banks, or banks of codec blocks kept as
stored: CODEC_IDS), the torch reference otherwise.

Both take routing with -1 for pairs another branch computes, and return fp32 partial sums. Banks of
codec blocks are uint8 [E, 2I, row_bytes(H)] / [E, H, row_bytes(I)]; `codecs` names the two banks'. Both
take the experts' function and their gate/up biases (expert_fn.py); the down bias is the caller's.
"""

from __future__ import annotations

import ctypes

import torch

from freetoken.codecs import get_codec
from freetoken.runtime.moe.expert_fn import SILU, ExpertFn, PairBias
from freetoken.runtime.moe.experts import grouped_experts, stored_experts
from freetoken.runtime.moe.kernels.loader import bf16_dot_units, load_library
from freetoken.runtime.moe.pool import HUGE_PAGES

# codec name -> the id quant_dot.h knows it by: what the compiled kernel computes from in place (against
# fp32 activations), and the ids of the codecs it can also take against int8 activation blocks
CODEC_IDS = {
    "bf16": 0, "Q8_0": 1, "Q4_K": 3, "Q6_K": 4, "f32": 7, "Q5_K": 8, "IQ4_XS": 10, "MXFP4": 12, "FP8": 14,
    "NVFP4": 15, "Q4_0": 17, "Q5_0": 18, "Q2_K": 19, "Q3_K": 20, "IQ2_XXS": 21, "IQ2_XS": 22, "IQ3_XXS": 23,
    "IQ3_S": 24, "IQ4_NL": 25, "Q4_1": 26, "Q5_1": 27,
}  # fmt: skip
INT8_ACT_IDS = {"Q8_0": 2, "Q4_K": 5, "Q6_K": 6, "Q5_K": 9, "IQ4_XS": 11, "MXFP4": 13}
INT8_ACT_IDS |= {name: CODEC_IDS[name] + 23 for name in CODEC_IDS if 17 <= CODEC_IDS[name] <= 27}  # 40-50
# weight-only codecs whose rows the kernel widens for several pairs (experts_cpu.c widened_codec): a bf16
# model's activations between the projections are rounded to bf16 where both of a layer's codecs are these
WIDENED_CODECS = frozenset({"Q8_0", "Q4_K", "Q6_K", "Q5_K", "IQ4_XS", "MXFP4", "FP8", "NVFP4"}) | frozenset(
    {"Q4_0", "Q5_0", "Q2_K", "Q3_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ3_S", "IQ4_NL", "Q4_1", "Q5_1"}
)
BF16_ACT16_ID = 16  # bf16 rows against bf16 activations, by the CPU's bf16 dot instructions
BF16 = ("bf16", "bf16")
BANK_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}  # codecs held as plain tensors; others as bytes


class ExpertFnC(ctypes.Structure):
    """expert_fn.h's ft_expert_fn."""

    _fields_ = [
        ("kind", ctypes.c_int),
        ("alpha", ctypes.c_float),
        ("limit", ctypes.c_float),
        ("gate_up_bias", ctypes.c_void_p),
    ]


def expert_fn_c(fn: ExpertFn, gate_up_bias: torch.Tensor | None) -> ExpertFnC | None:
    """The kernel's form of an experts' function (None: plain SiLU without biases); `gate_up_bias`
    [E, 2I] fp32 contiguous on the host, kept alive by the caller."""
    if fn == SILU and gate_up_bias is None:
        return None
    if gate_up_bias is not None:
        assert gate_up_bias.dtype == torch.float32 and gate_up_bias.is_contiguous()
    bias = None if gate_up_bias is None else gate_up_bias.data_ptr()
    return ExpertFnC(fn.code, fn.alpha, fn.limit, bias)


def kernel_available() -> bool:
    return load_library() is not None


# Cores left to the thread that launches GPU work and waits for each step's tokens while the CPU branch
# runs (it spins there when it has a core: decode_graph.SlotDecoder.follow_host_threads). Measured on a
# 16-core host (24-layer Q4_K decode, no expert on the GPU, spinning wait): 15 branch threads 124 tok/s,
# 14 threads 114; 16 threads leave the waiter no core (it then sleeps; 0.9-0.95x of 14 threads).
RESERVED_CORES = 1


def branch_threads() -> int:
    """Default threads of the CPU expert kernel: every torch thread, less RESERVED_CORES with CUDA."""
    threads = torch.get_num_threads()
    if torch.cuda.is_available() and threads > 2 * RESERVED_CORES:
        return threads - RESERVED_CORES
    return threads


def kernel_takes(gate_up_bank: torch.Tensor, down_bank: torch.Tensor, codecs: tuple[str, str] = BF16) -> bool:
    """Whether the compiled kernel computes from these banks: contiguous, in its codecs (`codecs` names
    them; plain bf16/f32 tensors, or uint8 blocks)."""
    if not (gate_up_bank.is_contiguous() and down_bank.is_contiguous()):
        return False
    if any(c not in CODEC_IDS for c in codecs):
        return False
    if gate_up_bank.dtype == down_bank.dtype == torch.uint8:
        return True  # blocks, or plain values as bytes
    banks = (gate_up_bank, down_bank)
    return all(bank.dtype == BANK_DTYPES.get(c) for bank, c in zip(banks, codecs, strict=True))


def codec_ids(codecs: tuple[str, str], int8_act: bool = False, bf16_act: bool = False) -> tuple[int, int]:
    """The kernel's ids of a layer's two bank codecs (kernel_takes them); `bf16_act`: bf16 banks against
    bf16 activations (bf16_activations)."""

    def one(name: str) -> int:
        if name == "bf16" and bf16_act:
            return BF16_ACT16_ID
        return (INT8_ACT_IDS.get(name) if int8_act else None) or CODEC_IDS[name]

    return one(codecs[0]), one(codecs[1])


def bf16_activations(dtype: torch.dtype) -> bool:
    """Whether the kernel computes a `dtype` model's bf16 experts against bf16 activations: a bf16 model
    (its hidden states are bf16 already; the activation between the projections is rounded to bf16, as
    the model's own experts round it) on a CPU with bf16 dot instructions (AVX512-BF16), where that is
    1.6-1.7 x faster than widening the rows to fp32 (64 experts of 1024 x 512, top-8, 64 or 128 rows,
    2-core EPYC: 18.9 -> 11.5 ms and 36.1 -> 21.1 ms a layer)."""
    return dtype == torch.bfloat16 and bf16_dot_units()


def bank_sizes(gate_up_bank: torch.Tensor, down_bank: torch.Tensor) -> tuple[int, int]:
    """(H, I) of a layer's banks, whatever they hold (the last dim of stored banks is bytes)."""
    return down_bank.shape[1], gate_up_bank.shape[1] // 2


def stored_reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_bank: torch.Tensor,
    down_bank: torch.Tensor,
    codecs: tuple[str, str],
    fn: ExpertFn = SILU,
    gate_up_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The plain path over banks of codec blocks: the routed experts dequantised by each codec's reference
    (gguf's for GGUF types), then the fp32 grouped experts. -> [T, H] float32."""
    bias = None if gate_up_bias is None else PairBias(gate_up_bias, ids)
    return stored_experts(
        x.float(), ids.long(), weights.float(), gate_up_bank, down_bank, codecs, fn, bias, _reference_rows
    )


def bf16_act_reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_bank: torch.Tensor,
    down_bank: torch.Tensor,
    fn: ExpertFn = SILU,
    codecs: tuple[str, str] | None = None,
) -> torch.Tensor:
    """What the kernel computes with bf16 activations, in plain torch: the gate/up dots in fp32, the
    weighted activation rounded to bf16, the down dots in fp32. bf16 banks (`bf16_act`; codecs None): x
    rounded to bf16 first. Banks of `codecs` blocks (dequantised by each codec's reference): a bf16
    model's pairs (x a bf16 row) round the activation where the CPU has bf16 dot units and both codecs
    are WIDENED_CODECS, other pairs keep it fp32 (stored_reference). -> [T, H] float32 (the kernel
    differs from it by fp32 rounding only)."""
    if codecs is None:
        xb, gate_up, down = x.bfloat16().float(), gate_up_bank.float(), down_bank.float()
        rounded = torch.ones(x.shape[0], dtype=torch.bool)
    else:
        h, i = bank_sizes(gate_up_bank, down_bank)
        xb = x.float()
        gate_up, down = _reference_rows(gate_up_bank, codecs[0], h), _reference_rows(down_bank, codecs[1], i)
        widened = bf16_dot_units() and set(codecs) <= WIDENED_CODECS
        rounded = (xb == xb.bfloat16().float()).all(dim=1) & widened
    out = torch.zeros(x.shape[0], down.shape[1])
    for expert in ids[ids >= 0].unique().tolist():
        rows, cols = (ids == expert).nonzero(as_tuple=True)
        gate, up = (xb[rows] @ gate_up[expert].T).chunk(2, dim=-1)  # [t, I] each
        act = fn.glu(gate, up) * weights[rows, cols, None].float()
        act = torch.where(rounded[rows, None], act.bfloat16().float(), act)
        out.index_add_(0, rows, act @ down[expert].T)
    return out


def _reference_rows(raw: torch.Tensor, codec: str, elements: int) -> torch.Tensor:
    """Rows of blocks dequantised by the codec's reference (gguf's for GGUF types)."""
    return torch.from_numpy(get_codec(codec).dequantize(raw.numpy(), elements, f"{codec} bank"))


def cpu_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_bank: torch.Tensor,
    down_bank: torch.Tensor,
    threads: int | None = None,
    use_kernel: bool = True,
    out: torch.Tensor | None = None,
    codecs: tuple[str, str] = BF16,
    int8_act: bool = False,
    fn: ExpertFn = SILU,
    gate_up_bias: torch.Tensor | None = None,
    bf16_act: bool | None = None,
) -> torch.Tensor:
    """x [T, H], ids [T, K] (int, -1 = skip), weights [T, K], banks [E, 2I, H] / [E, H, I] on the host
    (or codec blocks, `codecs` naming them; `int8_act`: quantized rows against int8 activation blocks);
    `fn` and `gate_up_bias` [E, 2I] (fp32, host): the experts' function and biases; `bf16_act`: bf16 banks
    against bf16 activations (None: bf16_activations(x.dtype); a caller staging a bf16 model's rows in
    fp32 passes the model's choice).

    -> [T, H] float32 (written into `out` when given). Banks the kernel does not take go the torch way.
    """
    lib = load_library() if use_kernel else None
    if (
        lib is None
        or not kernel_takes(gate_up_bank, down_bank, codecs)
        or matrix_units_take(x, codecs, int8_act)
    ):
        with torch.inference_mode():
            if gate_up_bank.dtype == torch.uint8:
                result = stored_reference(x, ids, weights, gate_up_bank, down_bank, codecs, fn, gate_up_bias)
            else:
                dtype = gate_up_bank.dtype
                bias = None if gate_up_bias is None else PairBias(gate_up_bias, ids)
                result = grouped_experts(
                    x.to(dtype), ids, weights.to(dtype), gate_up_bank, down_bank, fn, bias
                ).float()
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.empty(x.shape[0], bank_sizes(gate_up_bank, down_bank)[0], dtype=torch.float32)
    threads = threads or branch_threads()
    bf16_act = bf16_activations(x.dtype) if bf16_act is None else bf16_act
    run_kernel(
        lib, x, ids, weights, gate_up_bank, down_bank, out, threads, codecs=codecs, int8_act=int8_act, fn=fn,
        gate_up_bias=gate_up_bias, bf16_act=bf16_act,
    )  # fmt: skip
    return out


MATRIX_ROWS = 224  # rows from which bf16 experts go to torch's bf16 products on CPUs with bf16 dot units


def matrix_units_take(x: torch.Tensor, codecs: tuple[str, str], int8_act: bool) -> bool:
    """bf16 rows and banks, many rows, a CPU with bf16 dot units: torch's bf16 products (grouped by expert)
    beat the kernel there, even with its bf16 dots (bf16_activations) — 2-core AVX512-BF16 EPYC, 64
    experts of 1024 x 512, top-8, kernel vs torch: 11.1 vs 21.3 ms at 64 rows, 23.2 vs 26.0 at 128, 28.4
    vs 29.9 at 192, 37.9 vs 34.4 at 256, 66.7 vs 51.1 at 512. Gate/up come out rounded to bf16 before the
    activation, as in a bf16 model's own experts."""
    return (
        x.shape[0] >= MATRIX_ROWS
        and x.dtype == torch.bfloat16
        and codecs == BF16
        and not int8_act
        and bf16_dot_units()
    )


def _kernel_args(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_bank: torch.Tensor,
    down_bank: torch.Tensor,
    out: torch.Tensor,
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """(tensors to keep alive for the call, ft_moe_bf16's arguments up to `out`)."""
    assert out.is_contiguous() and out.dtype == torch.float32, "the kernel writes a contiguous fp32 out"
    hidden, inter = bank_sizes(gate_up_bank, down_bank)
    xf = x.float().contiguous()
    ids64 = ids.to(torch.int64).contiguous()
    w32 = weights.float().contiguous()
    tokens, top_k = ids64.shape
    scratch = torch.empty(tokens * (top_k * (inter + hidden) + hidden), dtype=torch.float32)
    args = (
        gate_up_bank.data_ptr(),
        down_bank.data_ptr(),
        gate_up_bank.shape[0],
        hidden,
        inter,
        xf.data_ptr(),
        ids64.data_ptr(),
        w32.data_ptr(),
        tokens,
        top_k,
        scratch.data_ptr(),
        out.data_ptr(),
    )
    return (xf, ids64, w32, scratch, out, gate_up_bank, down_bank), args


def _checked(pairs: int) -> int:
    if pairs == -2:
        raise ValueError("the CPU expert kernel does not take these banks' codecs or row lengths")
    if pairs < 0:
        raise MemoryError("the CPU expert kernel could not allocate its routing plan")
    return pairs


def run_kernel(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_bank: torch.Tensor,
    down_bank: torch.Tensor,
    out: torch.Tensor,
    threads: int,
    unit_bytes: int = 0,
    trace: torch.Tensor | None = None,
    codecs: tuple[str, str] = BF16,
    int8_act: bool = False,
    fn: ExpertFn = SILU,
    gate_up_bias: torch.Tensor | None = None,
    bf16_act: bool = False,
) -> int:
    """out [T, H] fp32 = the experts `ids` [T, K] (-1 = skip) over x [T, H], banks contiguous, bf16 or
    blocks of `codecs` (CODEC_IDS); `fn`, `gate_up_bias` [E, 2I] fp32: the experts' function and biases;
    `bf16_act`: bf16 banks against bf16 activations.

    The kernel groups the pairs by expert itself. `unit_bytes`: weight bytes per unit of work that the
    threads take in turn (0: the kernel's default). `trace`: a [threads + 1, 4] float64 tensor that receives
    each thread's (start, end, seconds waited, units) of the call, then a row of the threads joined and the
    call's end (seconds from its start) and two zeros. Returns the number of pairs computed.
    """
    _, args = _kernel_args(x, ids, weights, gate_up_bank, down_bank, out)
    gu, dn = codec_ids(codecs, int8_act, bf16_act)
    moe_args = (args[0], gu, args[1], dn, *args[2:])
    fn_c = expert_fn_c(fn, gate_up_bias)
    trace_ptr = None if trace is None else trace.data_ptr()
    return _checked(
        lib.ft_moe(*moe_args, threads, unit_bytes, trace_ptr, None if fn_c is None else ctypes.byref(fn_c))
    )


class KernelWorker:
    """A native thread that runs the kernel: `start` returns at once, `wait` blocks with the interpreter
    lock released. The call starts without the lock, which the thread driving the GPU keeps while it
    issues fills and kernels. One call in flight at a time."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.handle = lib.ft_worker_new()
        if not self.handle:
            raise RuntimeError("could not start the CPU expert kernel's thread")
        self._keep: tuple[torch.Tensor, ...] | None = None

    def start(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        gate_up_bank: torch.Tensor,
        down_bank: torch.Tensor,
        out: torch.Tensor,
        threads: int,
        bf16_act: bool = False,
    ) -> None:
        """As run_kernel over bf16 banks, in the background; the tensors are held until `wait`."""
        keep, args = _kernel_args(x, ids, weights, gate_up_bank, down_bank, out)
        codec = codec_ids(BF16, bf16_act=bf16_act)[0]
        if self.lib.ft_worker_submit(self.handle, *args, threads, 0, codec) != 0:
            raise RuntimeError("a CPU expert call is already in flight on this worker")
        self._keep = keep

    def wait(self) -> int:
        """Pairs computed by the call in flight."""
        if self._keep is None:
            raise RuntimeError("no CPU expert call is in flight on this worker")
        pairs = self.lib.ft_worker_wait(self.handle)
        self._keep = None
        return _checked(pairs)

    def close(self) -> None:
        if self.handle:
            self.lib.ft_worker_free(self.handle)
            self.handle = None
            self._keep = None


def llc_bytes() -> int:
    """The largest CPU cache on this machine in bytes (sysfs), 32 MiB when it cannot be read."""
    from pathlib import Path

    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes, default=32 << 20)


def beyond_cache_bytes() -> int:
    """A working set no cache can hold: 4 × the last-level cache (the STREAM rule), at least 1 GiB."""
    return max(1 << 30, 4 * llc_bytes())


def read_bandwidth(
    nbytes: int | None = None, threads: int | None = None, reps: int = 5, huge_pages: bool = HUGE_PAGES
) -> float:
    """Host read ceiling in bytes/s (STREAM-like sum over all cores); torch when the kernel is absent.
    The buffer lies in pages of the kind the expert pool uses."""
    import time

    from freetoken.formats.ftw import aligned_empty

    nbytes = nbytes or beyond_cache_bytes()
    buf = aligned_empty((nbytes // 4,), torch.float32, huge=huge_pages).fill_(1.0)
    lib = load_library()
    threads = threads or torch.get_num_threads()
    if lib is not None:
        ptr = ctypes.cast(buf.data_ptr(), ctypes.POINTER(ctypes.c_float))
        lib.ft_read_f32(ptr, buf.numel(), threads)
        t0 = time.perf_counter()
        for _ in range(reps):
            lib.ft_read_f32(ptr, buf.numel(), threads)
    else:
        buf.sum()
        t0 = time.perf_counter()
        for _ in range(reps):
            buf.sum()
    return reps * buf.numel() * 4 / (time.perf_counter() - t0)
