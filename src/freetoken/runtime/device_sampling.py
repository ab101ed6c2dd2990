"""Sampling on the device, one draw per row, with no host sync and fixed shapes (CUDA-graph capturable).

Each row follows `Sampler.filtered_probs` (temperature, top-k, then top-p in HF's order) and draws with
the Gumbel-max trick: argmax(filtered scores + Gumbel noise) is a draw from their softmax. The noise is
counter-based: for token j of a row it is a splitmix64 hash of (seed, step, j), so a draw depends on
the row's seed, step and logits only — not on the batch, the row's position, the device or torch's RNG.
`SamplingRows` holds the per-row parameters in static device buffers, staged through pinned memory.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch

from freetoken.runtime.sampling import SAMPLING_EPS, SamplingParams

_M64 = (1 << 64) - 1


def _i64(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits (torch scalars must fit int64)."""
    value &= _M64
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN = _i64(0x9E3779B97F4A7C15)  # splitmix64's increment
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)
_LOW52 = (1 << 52) - 1


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits: torch's >> is arithmetic, so mask off the copied sign bits."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplication wraps mod 2**64, as in C)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def row_keys(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """seed [B] i64, step [B] i64 -> key [B] i64: the start of the row's noise stream for this step."""
    return mix64(mix64(seed + GOLDEN) + (step + 1) * GOLDEN)


def uniforms(key: torch.Tensor, vocab: int) -> torch.Tensor:
    """key [B] i64 -> u [B, V] f64 in (0, 1): u[b, j] from the hash of (key[b], j), 52 random bits."""
    index = torch.arange(1, vocab + 1, dtype=torch.int64, device=key.device)  # [V]
    bits = _shr(mix64(key[:, None] + index * GOLDEN), 12)  # [B, V], 52 bits
    return (bits.double() + 0.5) * 2.0**-52  # k + 0.5 with k < 2**52 is exact in fp64: never 0 or 1


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] seeds and steps -> Gumbel(0, 1) noise [B, V] f32, a pure function of (seed, step, token)."""
    u = uniforms(row_keys(seed, step), vocab)
    return (-torch.log(-torch.log(u))).float()


def greedy_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (argmax tokens [B] i64, finite [B] bool): the fast path when every row is greedy.
    On the CPU one native pass over each row (torch's argmax over bf16 takes ~250 µs for 32k logits)."""
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype in (torch.bfloat16, torch.float32):
        from freetoken.runtime.moe.kernels.loader import load_library

        lib = load_library()
        if lib is not None:
            logits = logits.contiguous()
            out = torch.empty(logits.shape[0], 2, dtype=torch.int64)
            lib.ft_greedy_rows(
                logits.data_ptr(), logits.element_size(), logits.shape[0], logits.shape[1], out.data_ptr()
            )
            return out[:, 0], out[:, 1].bool()
    return greedy_rows_reference(logits)


def greedy_rows_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy_rows` in torch ops (what runs on CUDA, and the CPU kernel's oracle)."""
    return torch.argmax(logits, dim=-1), torch.isfinite(logits).all(dim=-1)


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    filters: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: logits [B, V]; temperature [B] f32, top_k [B] int (0: all), top_p [B] f32,
    seed [B] i64, step [B] i64 (all on the logits' device) -> (tokens [B] i64, finite [B] bool).

    A row is greedy (argmax of the raw logits) when temperature < SAMPLING_EPS or top_k == 1. A row
    whose logits are not all finite gets an arbitrary token and finite False (the caller raises).
    `filters` False: the caller knows no row has top-k or top-p, so the sort over the vocabulary is
    skipped (the same draws: with neither filter nothing is dropped).
    """
    vocab = logits.shape[-1]
    raw = logits.float()  # [B, V]
    greedy = (temperature < SAMPLING_EPS) | (top_k == 1)  # [B]
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature).float()  # no 1/0 on greedy rows
    scores = raw / safe_t[:, None]  # [B, V]
    if filters:
        scores = scores.masked_fill(_filtered_out(scores, top_k, top_p), float("-inf"))
    sampled = torch.argmax(scores + gumbel_noise(seed, step, vocab), dim=-1)  # [B]
    tokens, finite = greedy_rows(raw)
    return torch.where(greedy, tokens, sampled), finite


def _filtered_out(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """What top-k, then top-p, drop from scores [B, V] -> [B, V] bool, in token order."""
    vocab = scores.shape[-1]
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True, stable=True)  # [B, V] each
    # top-k: keep scores >= the k-th largest (ties at the k-th value stay); k 0 or >= V keeps all.
    k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k).clamp(1, vocab).long()  # [B]
    kth = sorted_scores.gather(1, (k - 1)[:, None])  # [B, 1]
    drop_sorted = sorted_scores < kth  # [B, V]
    # top-p over what top-k left: drop a token when the mass before it already reaches top_p.
    kept_scores = sorted_scores.masked_fill(drop_sorted, float("-inf"))
    probs = kept_scores.softmax(dim=-1)  # [B, V]
    before = probs.cumsum(dim=-1) - probs  # [B, V]
    nucleus = (top_p < 1.0)[:, None]  # [B, 1]: top_p 1 is off (rounding must not drop the tail)
    drop_sorted |= nucleus & (before >= top_p[:, None].float())
    return torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)  # [B, V], in token order


def filtered(params: SamplingParams) -> bool:
    """Whether a sampled request keeps only part of the vocabulary (top-k or top-p)."""
    return params.top_k > 0 or params.top_p < 1.0


def request_seed(params: SamplingParams) -> int:
    """The seed a request samples with: params.seed (its 64 bits read as an int64), else 63 random bits."""
    return _i64(params.seed) if params.seed is not None else secrets.randbits(63)


class SamplingRows:
    """Per-row sampling parameters in static device buffers, for up to `max_rows` rows.

    Per step: `set_row(i, ...)` for each row (host only, into pinned staging), `upload(n)` (async
    copies of rows [:n]), then `sample(logits[:n])`, which reads views [:n] of the device buffers and so
    can be captured once in a CUDA graph and replayed after later uploads. Two staging copies
    alternate, so writing the next step's rows never overwrites one a copy may still be reading.
    """

    def __init__(self, max_rows: int, device: torch.device | str) -> None:
        self.max_rows = max_rows
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        # floats [R, 2]: temperature, top_p; ints [R, 3]: top_k, seed, step. Row-major: rows [:n] contiguous.
        self._floats = torch.zeros(max_rows, 2, dtype=torch.float32, device=self.device)
        self._ints = torch.zeros(max_rows, 3, dtype=torch.int64, device=self.device)
        self._floats[:, 1] = 1.0
        self.temperature, self.top_p = self._floats[:, 0], self._floats[:, 1]
        self.top_k, self.seed, self.step = self._ints[:, 0], self._ints[:, 1], self._ints[:, 2]
        self._staging = [
            (
                self._floats.cpu().pin_memory() if cuda else self._floats.cpu().clone(),
                self._ints.cpu().pin_memory() if cuda else self._ints.cpu().clone(),
            )
            for _ in range(2)
        ]
        self._np = [(f.numpy(), i.numpy()) for f, i in self._staging]  # fast element writes
        self._events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._recorded = [False, False]
        self._cur = 0
        self._uploaded = False  # the current staging copy was handed to a copy since its last write
        self._greedy = [True] * max_rows
        self._filtered = [False] * max_rows  # rows with top-k or top-p

    def set_row(self, i: int, params: SamplingParams, seed: int, step: int) -> None:
        """Stage row i: `params`, the request's seed (int64 range) and step (tokens drawn so far)."""
        if self._uploaded:
            self._flip()
        floats, ints = self._np[self._cur]
        greedy = params.greedy
        floats[i, 0] = 0.0 if greedy else params.temperature  # greedy decided on the host, as Sampler does
        floats[i, 1] = params.top_p
        ints[i, 0] = params.top_k
        ints[i, 1] = seed
        ints[i, 2] = step
        self._greedy[i] = greedy
        self._filtered[i] = filtered(params)

    def _flip(self) -> None:
        """Move to the other staging copy (waiting for its last copy to the device, normally long done)
        and start it from the rows just uploaded."""
        other = 1 - self._cur
        event = self._events[other]
        if event is not None and self._recorded[other]:
            event.synchronize()  # waits on that one copy only; not a stream or device sync
        for dst, src in zip(self._np[other], self._np[self._cur], strict=True):
            np.copyto(dst, src)
        self._cur, self._uploaded = other, False

    def upload(self, n: int) -> None:
        """Copy staged rows [:n] to the device buffers, asynchronously (no host sync)."""
        floats, ints = self._staging[self._cur]
        self._floats[:n].copy_(floats[:n], non_blocking=True)
        self._ints[:n].copy_(ints[:n], non_blocking=True)
        event = self._events[self._cur]
        if event is not None:
            event.record()
            self._recorded[self._cur] = True
        self._uploaded = True

    def all_greedy(self, n: int) -> bool:
        """Whether staged rows [:n] are all greedy (host side: reads no device memory)."""
        return all(self._greedy[:n])

    def any_filtered(self, n: int) -> bool:
        """Whether a staged row of [:n] has top-k or top-p (host side)."""
        return any(self._filtered[:n])

    def sample(self, logits: torch.Tensor, filters: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [n, V] for rows [:n] -> (tokens [n] i64, finite [n] bool), on the device. `filters`
        False: no staged row has top-k or top-p (a captured graph keeps what it was captured with)."""
        n = logits.shape[0]
        t, k, p, seed, step = self.temperature, self.top_k, self.top_p, self.seed, self.step
        return sample_rows(logits, t[:n], k[:n], p[:n], seed[:n], step[:n], filters)
