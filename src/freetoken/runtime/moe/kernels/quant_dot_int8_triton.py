"""Dots of codec rows with int8 activations, for the int8 decode kernels (moe_decode_int8_triton.py): the
vector is quantized per block of 32 (quantize_blocks_kernel: q = rint(v / d), d = max|v| / 127, as the
CPU kernel's quantize_q8) and packed four to an int32 word, and the quants meet it four at a time in one
dp4a instruction, where the float path widens, scales and multiplies every weight (quant_dot_triton.py).
The sum is W · ṽ over the dequantised vector ṽ = d · q exactly, up to fp32 rounding of the partial sums.

  Q4_K (CODEC 3): a super-block's 128 nibble bytes as 32 int32 words [N, 4, 8] (chunk c, word w: bytes
    4w.. of the chunk's 32); word & 0x0F0F0F0F holds weights 64c + 4w + 0..3 (sub-block 2c), (word >> 4) &
    0x0F0F0F0F the same of 64c + 32 + 4w (sub-block 2c + 1); its header as four words (d | dmin << 16 and
    the 12 bytes of 6-bit scales and mins). Σ_j (d·sc·q_j − dmin·m)·ṽ_j = d·sc·d_v·dp4a(q, q_v) − dmin·m·s_v
    with s_v = d_v · Σ q_v, the block's sum. A sub-block's eight dp4a sums add in int32 and are scaled
    once; a chunk is read as two 16-byte loads of four words, so one thread holds it whole (batch 1 is
    bound by instructions a byte, not by HBM, when every word is widened and scaled on its own: sm_90
    SASS of a whole-row program, 32 rows, 690 -> 486 instructions a super-block row). A chunk's
    super-blocks are met one at a time ([N, 4, 4] tiles), or with TILE as one [N, S, 4, 4] tile whose
    loads are one tensor load each (sm_90 SASS, 8 rows a warp, whole rows: 248 -> 120 registers a thread,
    so twice the warps an SM; more warps a program hold fewer words each).
  Q8_0 (CODEC 1): blocks are 34 bytes (2-byte aligned), so two blocks (68 bytes, 17 words) are read as
    words from a 4-byte aligned pair start: the even block's quants straddle words (a funnel of halves), the
    odd block's are words 9..16. Needs rows of an even number of blocks (a multiple of 4 bytes).
  MXFP4 (CODEC 12), Q4_0 (17), IQ4_NL (25): blocks of 32 weights as 16 bytes of nibbles (byte j: weight j
    in the low nibble, j + 16 in the high) after a scale (MXFP4: an e8m0 byte e, 2^(e − 128), 17-byte
    blocks; the others an fp16 d, 18-byte blocks), each nibble an index into 16 int8 values (the doubled
    e2m1 values; n − 8; IQ4_NL's kvalues). A word of four code bytes becomes its eight weights' int8 values
    by byte permutes (prmt) of the table's four words (table16, as llama.cpp's get_int_from_table_16):
    8 permutes and 2 dp4a for 8 weights, where the float path widens, scales and multiplies each weight;
    a block's eight dp4a sums add in int32 and are scaled once.

Interpreted (TRITON_INTERPRET=1, CI) the dp4a and prmt are the same in plain integer operations (EMULATE),
so the interpreter checks the layout and the scales; the instructions themselves are checked by the GPU
tests.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from freetoken.codecs.torch_lowbit import IQ4_NL_VALUES
from freetoken.runtime.moe.kernels.block_bits_triton import (
    fp16_at,
    fp16_low,
    k4_header,
    k4_scale_min,
    k4_scale_min_words,
    unaligned_words,
)


def table_words(values: tuple[int, ...]) -> tuple[int, ...]:
    """16 int8 values -> table16's four table words: values 4w..4w + 3 little-endian in word w, as signed
    int32."""
    packed = [sum((v & 255) << (8 * b) for b, v in enumerate(values[4 * w : 4 * w + 4])) for w in range(4)]
    return tuple(p - (1 << 32) if p >= 1 << 31 else p for p in packed)


# the nibble codecs' tables (table16): MXFP4's doubled e2m1 values (its scale halved), Q4_0's n − 8, IQ4_NL's
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# (one constexpr a word: a kernel indexes no tuple)
MXFP4_T0, MXFP4_T1, MXFP4_T2, MXFP4_T3 = (tl.constexpr(w) for w in table_words(E2M1_DOUBLED))
Q4_0_T0, Q4_0_T1, Q4_0_T2, Q4_0_T3 = (tl.constexpr(w) for w in table_words(tuple(range(-8, 8))))
IQ4_NL_T0, IQ4_NL_T1, IQ4_NL_T2, IQ4_NL_T3 = (tl.constexpr(w) for w in table_words(IQ4_NL_VALUES))


@triton.jit
def dp4a(a, b, SIGNED_A: tl.constexpr, EMULATE: tl.constexpr):
    """Σ_i byte i of a × byte i of b (int32 tensors of one shape; b's bytes signed, a's signed when
    SIGNED_A, else unsigned)."""
    if EMULATE:
        total = tl.zeros(a.shape, tl.int32)
        for i in tl.static_range(4):
            byte_a = (a >> (8 * i)) & 255
            if SIGNED_A:
                byte_a = (byte_a ^ 128) - 128
            total += byte_a * ((((b >> (8 * i)) & 255) ^ 128) - 128)
        return total
    else:
        if SIGNED_A:
            return tl.inline_asm_elementwise(
                "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, tl.zeros(a.shape, tl.int32)],
                dtype=tl.int32, is_pure=True, pack=1,
            )  # fmt: skip
        else:
            return tl.inline_asm_elementwise(
                "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, tl.zeros(a.shape, tl.int32)],
                dtype=tl.int32, is_pure=True, pack=1,
            )  # fmt: skip


@triton.jit
def prmt(a, b, sel, EMULATE: tl.constexpr):
    """PTX's byte permute of int32 tensors of one shape: result byte k is byte (sel >> 4k) & 7 of the eight
    bytes {a's 0-3, b's as 4-7}, or where bit 3 of that nibble is set, that byte's sign bit replicated
    (callers mask selectors with & 0x7777 for plain bytes)."""
    if EMULATE:
        out = tl.zeros(a.shape, tl.int32)
        for k in tl.static_range(4):
            nibble = (sel >> (4 * k)) & 15
            byte = (tl.where((nibble & 4) == 0, a, b) >> (8 * (nibble & 3))) & 255
            byte = tl.where(nibble >= 8, ((byte >> 7) & 1) * 255, byte)
            out = out | (byte << (8 * k))
        return out
    else:
        return tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], dtype=tl.int32, is_pure=True, pack=1
        )


@triton.jit
def _table_quad(s, t0, t1, t2, t3, EMULATE: tl.constexpr):
    """The table values of the four nibbles in the low 16 bits of s, as bytes in nibble order (table words
    t0..t3 broadcast to s's shape)."""
    sel = s & 0x7777
    low = prmt(t0, t1, sel, EMULATE)  # byte k: table[nibble k & 7]
    high = prmt(t2, t3, sel, EMULATE)  # byte k: table[8 + (nibble k & 7)]
    return prmt(low, high, 0x3210 | ((s & 0x8888) >> 1), EMULATE)  # high's byte k where nibble k >= 8


@triton.jit
def table16(q4, t0, t1, t2, t3, EMULATE: tl.constexpr):
    """q4: int32 words of four code bytes (byte i: weight j + i in its low nibble, j + 16 + i in its high)
    -> (lo, hi) int32 words of the int8 table values of weights j..j + 3 and j + 16..j + 19. t0..t3: the
    table's 16 int8 values, four a word little-endian (table_words)."""
    # (q4.shape each time: a shape held in a local becomes a tuple of tensors when compiled)
    t0, t1 = tl.full(q4.shape, t0, tl.int32), tl.full(q4.shape, t1, tl.int32)
    t2, t3 = tl.full(q4.shape, t2, tl.int32), tl.full(q4.shape, t3, tl.int32)
    even = _table_quad(q4, t0, t1, t2, t3, EMULATE)  # weights j, j + 16, j + 1, j + 17
    odd = _table_quad(q4 >> 16, t0, t1, t2, t3, EMULATE)  # weights j + 2, j + 18, j + 3, j + 19
    lo = prmt(even, odd, tl.full(q4.shape, 0x6420, tl.int32), EMULATE)
    hi = prmt(even, odd, tl.full(q4.shape, 0x7531, tl.int32), EMULATE)
    return lo, hi


@triton.jit
def quantize_tile(v):
    """v [NB, 32] fp32 -> (quants as int32 words [NB, 8], scales [NB], sums d · Σ q [NB]): q = rint(v / d),
    d = max|v| / 127, ties to even."""
    amax = tl.max(tl.abs(v), axis=1)
    inv = tl.where(amax > 0.0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    # 12582912 = 1.5 · 2^23: (t + M) − M rounds |t| < 2^22 to the nearest integer, ties to even, in fp32
    q = ((v * inv[:, None] + 12582912.0) - 12582912.0).to(tl.int32)  # [NB, 32] in -127..127
    d = amax / 127.0
    quads = tl.reshape(q & 255, [v.shape[0], 8, 4])
    words = tl.sum(quads << (8 * tl.arange(0, 4))[None, None, :], axis=2)  # disjoint bytes: the sum is an or
    return words, d, d * tl.sum(q, axis=1).to(tl.float32)


@triton.jit
def store_quantized(v, block, live, q_ptr, d_ptr, s_ptr):
    """Blocks `block` ([NB]; `live` [NB]) of a vector, v [NB, 32] fp32, quantized into its words [W / 4],
    scales and sums [W / 32] at q_ptr / d_ptr / s_ptr."""
    words, d, sums = quantize_tile(v)
    tl.store(q_ptr + block[:, None] * 8 + tl.arange(0, 8)[None, :], words, mask=live[:, None])
    tl.store(d_ptr + block, d, mask=live)
    tl.store(s_ptr + block, sums, mask=live)


@triton.jit
def quantize_blocks_kernel(
    v_ptr,  # [R, W] float
    q_ptr,  # [R, W / 4] int32 out: four int8 quants a word, little-endian
    d_ptr,  # [R, W / 32] fp32 out: scales
    s_ptr,  # [R, W / 32] fp32 out: d · Σ q, the dequantised block's sum
    W: tl.constexpr,  # a multiple of 32
    NB: tl.constexpr,  # blocks per program
    PDL: tl.constexpr,  # launched as a programmatic dependent of the kernel that writes v
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0)
    block = tl.program_id(1) * NB + tl.arange(0, NB)
    live = block * 32 < W
    j = tl.arange(0, 32)
    v = tl.load(v_ptr + row * W + block[:, None] * 32 + j[None, :], mask=live[:, None], other=0.0)
    store_quantized(
        v.to(tl.float32),
        block,
        live,
        q_ptr + row * (W // 4),
        d_ptr + row * (W // 32),
        s_ptr + row * (W // 32),
    )


@triton.jit
def q4k_tile_load(rows, live, sb0, limit, S: tl.constexpr):
    """The words of super-blocks sb0 .. sb0 + S − 1 of rows `rows` ([N] byte pointers; `live` [N]; at or
    past `limit` nothing is read) as one tile, every load issued at once -> (first, second [N, S, 4, 4]:
    a chunk's two 16-byte halves; head [N, S]: d | dmin << 16; s0, s1, s2 [N, S]: the scale bytes)."""
    sb = sb0 + tl.arange(0, S)  # [S]
    here = sb * 256 < limit  # [S]: rows are whole super-blocks
    base = (rows[:, None] + sb[None, :] * 144).to(tl.pointer_type(tl.int32))  # [N, S]
    row_here = live[:, None] & here[None, :]  # [N, S]
    c = tl.arange(0, 4)
    w = tl.arange(0, 4)
    chunk = (4 + 8 * c[:, None] + w[None, :])[None, None]  # [1, 1, 4, 4]: a chunk's first four words
    mask = row_here[:, :, None, None]
    first = tl.load(base[:, :, None, None] + chunk, mask=mask, other=0)  # [N, S, 4, 4]
    second = tl.load(base[:, :, None, None] + chunk + 4, mask=mask, other=0)
    head = tl.load(base, mask=row_here, other=0)  # [N, S]: d | dmin << 16, then the scale bytes
    s0 = tl.load(base + 1, mask=row_here, other=0)
    s1 = tl.load(base + 2, mask=row_here, other=0)
    s2 = tl.load(base + 3, mask=row_here, other=0)
    return first, second, head, s0, s1, s2


@triton.jit
def q4k_tile_dot(first, second, head, s0, s1, s2, q_ptr, d_ptr, s_ptr, sb0, limit, S: tl.constexpr,
                 EMULATE: tl.constexpr):  # fmt: skip
    """A q4k_tile_load tile against the quantized vector -> [N, 4] fp32 partial products (chunk c:
    sub-blocks 2c and 2c + 1, summed over the super-blocks) and [N] fp32 min terms to subtract. A
    sub-block's eight words meet the vector in int32 and are scaled once."""
    sb = sb0 + tl.arange(0, S)
    here = sb * 256 < limit
    c = tl.arange(0, 4)
    w = tl.arange(0, 4)
    v_at = q_ptr + (sb * 64)[:, None, None] + (16 * c[:, None] + w[None, :])[None]  # [S, 4, 4]: low nibbles'
    v_here = here[:, None, None]
    lo = tl.sum(
        dp4a(first & 0x0F0F0F0F, tl.load(v_at, mask=v_here, other=0)[None], False, EMULATE)
        + dp4a(second & 0x0F0F0F0F, tl.load(v_at + 4, mask=v_here, other=0)[None], False, EMULATE),
        axis=3,
    )  # [N, S, 4]
    hi = tl.sum(
        dp4a((first >> 4) & 0x0F0F0F0F, tl.load(v_at + 8, mask=v_here, other=0)[None], False, EMULATE)
        + dp4a((second >> 4) & 0x0F0F0F0F, tl.load(v_at + 12, mask=v_here, other=0)[None], False, EMULATE),
        axis=3,
    )
    s0, s1, s2 = s0[:, :, None], s1[:, :, None], s2[:, :, None]
    sc_lo, mn_lo = k4_scale_min(s0, s1, s2, (2 * c)[None, None, :])  # [N, S, 4]
    sc_hi, mn_hi = k4_scale_min(s0, s1, s2, (2 * c + 1)[None, None, :])
    block = (sb * 8)[:, None] + 2 * c[None, :]  # [S, 4]: the vector's blocks of sub-blocks 2c
    b_here = here[:, None]
    part = fp16_low(head)[:, :, None] * (
        lo.to(tl.float32) * sc_lo * tl.load(d_ptr + block, mask=b_here, other=0.0)[None]
        + hi.to(tl.float32) * sc_hi * tl.load(d_ptr + block + 1, mask=b_here, other=0.0)[None]
    )
    mins = tl.sum(
        mn_lo * tl.load(s_ptr + block, mask=b_here, other=0.0)[None]
        + mn_hi * tl.load(s_ptr + block + 1, mask=b_here, other=0.0)[None],
        axis=2,
    )  # [N, S]
    return tl.sum(part, axis=1), tl.sum(fp16_low(head >> 16) * mins, axis=1)


@triton.jit
def _q4k_int8_tile(rows, live, q_ptr, d_ptr, s_ptr, sb0, limit, S: tl.constexpr, EMULATE: tl.constexpr,
                   WAIT: tl.constexpr):  # fmt: skip
    """Super-blocks sb0 .. sb0 + S − 1 of rows `rows` ([N] byte pointers; `live` [N]) against the quantized
    vector, as one tile [N, S, 4, 4] (q4k_tile_load, then q4k_tile_dot): a chunk is two 16-byte loads one
    thread holds whole, and every load of the tile is one tensor load, so a thread issues all of its loads
    before it waits on any."""
    first, second, head, s0, s1, s2 = q4k_tile_load(rows, live, sb0, limit, S)
    if WAIT:  # the weights are in flight; the vector is the kernel before's output
        gdc_wait()
    return q4k_tile_dot(first, second, head, s0, s1, s2, q_ptr, d_ptr, s_ptr, sb0, limit, S, EMULATE)


@triton.jit
def _q4k_int8_block(rows, live, q_ptr, d_ptr, s_ptr, sb, limit, EMULATE: tl.constexpr, WAIT: tl.constexpr):
    """Super-block sb of rows `rows` ([N] byte pointers to row starts, `live` [N]; nothing read at or past
    `limit`, so a chunk past the row adds zeros, not 0 · whatever lies beyond) against the quantized vector
    -> [N, 4] fp32 partial products (chunk c: sub-blocks 2c and 2c + 1) and [N] fp32 min terms to
    subtract. A sub-block's eight words meet the vector in int32 and are scaled once (not once a word)."""
    base = rows + sb * 144
    live = live & (sb * 256 + tl.zeros(live.shape, tl.int32) < limit)
    c = tl.arange(0, 4)
    w = tl.arange(0, 4)
    at = (4 + 8 * c[:, None] + w[None, :])[None]  # [1, 4, 4]: a chunk's first four words
    words_at = base.to(tl.pointer_type(tl.int32))[:, None, None] + at
    mask = live[:, None, None]
    # a chunk's eight words as two loads of four: each thread holds a whole chunk (16-byte loads), so
    # the int32 sums stay in registers and a sub-block's scales are worked out once per chunk
    first = tl.load(words_at, mask=mask, other=0)  # [N, 4, 4]
    second = tl.load(words_at + 4, mask=mask, other=0)
    if WAIT:
        gdc_wait()
    v_at = q_ptr + sb * 64 + 16 * c[:, None] + w[None, :]  # [4, 4]: the vector's words of the low nibbles
    here = sb * 256 + 64 * c < limit  # [4]
    v_here = here[:, None]
    lo = tl.sum(
        dp4a(first & 0x0F0F0F0F, tl.load(v_at, mask=v_here, other=0)[None], False, EMULATE)
        + dp4a(second & 0x0F0F0F0F, tl.load(v_at + 4, mask=v_here, other=0)[None], False, EMULATE),
        axis=2,
    )  # [N, 4]
    hi = tl.sum(
        dp4a((first >> 4) & 0x0F0F0F0F, tl.load(v_at + 8, mask=v_here, other=0)[None], False, EMULATE)
        + dp4a((second >> 4) & 0x0F0F0F0F, tl.load(v_at + 12, mask=v_here, other=0)[None], False, EMULATE),
        axis=2,
    )
    head, s0, s1, s2 = k4_header(base, live)
    d = fp16_low(head)[:, None]
    dmin = fp16_low(head >> 16)
    sc_lo, mn_lo = k4_scale_min_words(s0, s1, s2, 2 * c)  # [N, 4]
    sc_hi, mn_hi = k4_scale_min_words(s0, s1, s2, 2 * c + 1)
    block = sb * 8 + 2 * c  # [4]: the vector's blocks of sub-blocks 2c
    part = d * (
        lo.to(tl.float32) * sc_lo * tl.load(d_ptr + block, mask=here, other=0.0)[None, :]
        + hi.to(tl.float32) * sc_hi * tl.load(d_ptr + block + 1, mask=here, other=0.0)[None, :]
    )
    mins = (
        mn_lo * tl.load(s_ptr + block, mask=here, other=0.0)[None, :]
        + mn_hi * tl.load(s_ptr + block + 1, mask=here, other=0.0)[None, :]
    )
    return part, dmin * tl.sum(mins, axis=1)


@triton.jit
def _q8_int8(rows, pair, live, pair_live, q_ptr, d_ptr, EMULATE: tl.constexpr, WAIT: tl.constexpr):
    """Block pairs `pair` ([P]: blocks 2p, 2p + 1, 68 bytes from byte 68p; the vector's read where
    `pair_live` [P]) of rows `rows` ([N]; live [N, P]) against the quantized vector -> [N, P] fp32
    partial products (a block's words summed in int32, then scaled once)."""
    j = tl.arange(0, 8)
    words_at = (rows[:, None] + 68 * pair[None, :]).to(tl.pointer_type(tl.int32))  # [N, P]
    at = words_at[:, :, None] + j[None, None, :]
    mask = live[:, :, None]
    first = tl.load(at, mask=mask, other=0)  # words 0..7: even d | quants 0-1, quants 2-29
    second = tl.load(at + 1, mask=mask, other=0)  # words 1..8: ..., quants 30-31 | odd d
    odd = tl.load(at + 9, mask=mask, other=0)  # words 9..16: the odd block's quants
    if WAIT:
        gdc_wait()
    even = ((first >> 16) & 0xFFFF) | (second << 16)
    d_even = fp16_low(tl.load(words_at, mask=live, other=0))
    d_odd = fp16_low(tl.load(words_at + 8, mask=live, other=0) >> 16)
    v_at = 16 * pair[:, None] + j[None, :]  # [P, 8]: the even block's words of the vector
    v_live = pair_live[:, None]
    sum_even = tl.sum(dp4a(even, tl.load(q_ptr + v_at, mask=v_live, other=0)[None], True, EMULATE), axis=2)
    sum_odd = tl.sum(dp4a(odd, tl.load(q_ptr + v_at + 8, mask=v_live, other=0)[None], True, EMULATE), axis=2)
    return (
        sum_even.to(tl.float32) * d_even * tl.load(d_ptr + 2 * pair, mask=pair_live, other=0.0)[None, :]
        + sum_odd.to(tl.float32) * d_odd * tl.load(d_ptr + 2 * pair + 1, mask=pair_live, other=0.0)[None, :]
    )


@triton.jit
def _nibble_words(rows, block, live, CODEC: tl.constexpr):
    """Blocks `block` ([NB]) of rows `rows` ([N] byte pointers; `live` [N, NB]) of a nibble codec -> (their
    code bytes as int32 words [N, NB, 4], word w bytes 4w..4w + 3 of the 16; their scales [N, NB] fp32)."""
    w = tl.arange(0, 4)[None, None, :]
    mask = live[:, :, None]
    if CODEC == 12:  # MXFP4: 17-byte blocks, 1-byte aligned: each code word from two aligned words
        base = rows[:, None] + block[None, :] * 17  # [N, NB]
        words = unaligned_words(base + 1, live)
        scale = tl.exp2(tl.load(base, mask=live, other=0).to(tl.float32) - 128.0)
    else:  # Q4_0 / IQ4_NL: 18-byte blocks (rows whole blocks), 2-byte aligned: halves combined
        base = rows[:, None] + block[None, :] * 18
        at = base.to(tl.pointer_type(tl.uint16))[:, :, None] + 1 + 2 * w
        low = tl.load(at, mask=mask, other=0).to(tl.int32)
        words = low | (tl.load(at + 1, mask=mask, other=0).to(tl.int32) << 16)
        scale = fp16_at(base, live)
    return words, scale


@triton.jit
def _nibble_int8(rows, block, live, block_live, q_ptr, d_ptr, CODEC: tl.constexpr, EMULATE: tl.constexpr,
                 WAIT: tl.constexpr):  # fmt: skip
    """Blocks `block` ([NB]; the vector's read where `block_live` [NB]) of rows `rows` ([N] byte pointers to
    row starts; `live` [N, NB]) of MXFP4 / Q4_0 / IQ4_NL against the quantized vector -> [N, NB] fp32
    partial products (a block's eight dp4a sums added in int32, then scaled once)."""
    words, scale = _nibble_words(rows, block, live, CODEC)
    if WAIT:  # the weights are in flight; the vector is the kernel before's output
        gdc_wait()
    if CODEC == 12:
        lo, hi = table16(words, MXFP4_T0, MXFP4_T1, MXFP4_T2, MXFP4_T3, EMULATE)
    elif CODEC == 17:
        lo, hi = table16(words, Q4_0_T0, Q4_0_T1, Q4_0_T2, Q4_0_T3, EMULATE)
    else:
        lo, hi = table16(words, IQ4_NL_T0, IQ4_NL_T1, IQ4_NL_T2, IQ4_NL_T3, EMULATE)
    # [NB, 4]: the vector's words of weights 4w..4w + 3 of each block (those of 16 + 4w.. four words on)
    v_at = q_ptr + 8 * block[:, None] + tl.arange(0, 4)[None, :]
    v_live = block_live[:, None]
    sums = tl.sum(
        dp4a(lo, tl.load(v_at, mask=v_live, other=0)[None], True, EMULATE)
        + dp4a(hi, tl.load(v_at + 4, mask=v_live, other=0)[None], True, EMULATE),
        axis=2,
    )  # [N, NB]
    return sums.to(tl.float32) * scale * tl.load(d_ptr + block, mask=block_live, other=0.0)[None, :]


@triton.jit
def int8_row_part(
    rows,
    live,
    q_ptr,
    d_ptr,
    s_ptr,
    k0,
    limit,
    CODEC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EMULATE: tl.constexpr,
    TILE: tl.constexpr,  # Q4_K: the chunk's super-blocks as one tile (_q4k_int8_tile)
    WAIT: tl.constexpr,  # PDL: wait for the kernel before once the weights are in flight
):
    """rows: [N] byte pointers to row starts; live: [N]; q/d/s: the quantized vector's words, scales and
    sums (its first element's) -> (an fp32 tile [N, A] and [N] fp32) whose row sums, the second
    subtracted, are Σ over k in [k0, k0 + BLOCK_K) ∩ [0, limit) of W[row, k] · ṽ[k]. Callers add the tiles
    of successive chunks elementwise and sum rows once (int8_row_sums)."""
    if CODEC == 3 and TILE:  # BLOCK_K // 256 super-blocks as one tile -> [N, 4]
        sb0 = k0 // 256
        return _q4k_int8_tile(rows, live, q_ptr, d_ptr, s_ptr, sb0, limit, BLOCK_K // 256, EMULATE, WAIT)
    elif CODEC == 3:  # one super-block at a time -> [N, 4]
        # only the first waits (PDL): a wait is also a fence the later super-blocks' loads cannot cross
        part, mins = _q4k_int8_block(rows, live, q_ptr, d_ptr, s_ptr, k0 // 256, limit, EMULATE, WAIT)
        for s in tl.static_range(1, BLOCK_K // 256):
            p, m = _q4k_int8_block(rows, live, q_ptr, d_ptr, s_ptr, k0 // 256 + s, limit, EMULATE, False)
            part += p
            mins += m
        return part, mins
    elif CODEC == 12 or CODEC == 17 or CODEC == 25:
        # MXFP4 / Q4_0 / IQ4_NL: BLOCK_K // 32 blocks -> [N, BLOCK_K // 32]
        block = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        block_live = block * 32 < limit
        here = live[:, None] & block_live[None, :]
        zeros = tl.zeros([live.shape[0]], dtype=tl.float32)
        return _nibble_int8(rows, block, here, block_live, q_ptr, d_ptr, CODEC, EMULATE, WAIT), zeros
    else:  # Q8_0: BLOCK_K // 64 block pairs -> [N, BLOCK_K // 64]
        pair = k0 // 64 + tl.arange(0, BLOCK_K // 64)
        pair_live = pair * 64 < limit
        here = live[:, None] & pair_live[None, :]
        zeros = tl.zeros([live.shape[0]], dtype=tl.float32)
        return _q8_int8(rows, pair, here, pair_live, q_ptr, d_ptr, EMULATE, WAIT), zeros


@triton.jit
def int8_row_sums(part, mins):
    """[N] fp32: the row sums of an int8_row_part accumulation."""
    return tl.sum(part, axis=1) - mins
