"""The expert cache's LRU step on the device: one MoE layer step's lookups, hit stamps, hybrid split
(which misses to fetch) and admissions, in place on device tensors, as one Triton launch with no host
sync and no data-dependent allocation (graph-capturable); residency.py holds the state it runs on.

State, on one device, modified in place:
  slot_of [L, E] int32    slot holding (row, expert), -1 = not resident
  owner [S] int32         flat key row·E + expert held by each slot, -1 = empty
  stamp [S] int64         last use of each slot on one global clock, -1 = empty
  clock [1] int64         the next stamp
  fetch [L] fp32          per row, the fraction f of misses to fetch
  counters [L, 5] int64   per row, accumulated: hits, misses, fills, evictions, cpu

One step, over the distinct experts D of ids (ids >= 0):
  1. hit: slot_of[row, e] >= 0; n hits, m misses
  2. hits stamped clock0, clock0 + 1, ... in ascending expert id
  3. q = clamp(floor(m·f + 0.5), 1, max(1, min(m, max_fetch))); 0 if m == 0 or f <= 0 (or f is NaN);
     then q = min(q, S - n). m·f is taken exactly in fp64 (f is a float32, m an integer), so the floor
     sees no rounding and compiled FMA contraction cannot change it
  4. the chosen misses: the first q in (token count desc, summed weight desc, expert id asc), weights
     summed in fp64 (exact, hence order-free, unless one expert's weights span over ~2^22 in magnitude)
  5. the chosen, in ascending id, take the q slots with the smallest (stamp, slot) among those with
     stamp < clock0 (empty ones first), in that order; a victim's old owner loses residency (an
     eviction); the r-th admitted gets stamp clock0 + n + r; plan[r] = (expert, slot)
  6. clock += n + q; count = q; counters[row] += (n, m, q, evictions, m - q)
  7. slot_ids = slot_of[row, ids] after the admissions (-1 for misses left to the CPU), -1 where ids < 0
Plan rows [q, P) are set to (-1, -1). Ids must lie in [-1, E).

`lru_ensure` launches the kernel (lru_ensure_triton.py) for decode-sized steps (T·K <= 128, E <= 1024) on
CUDA tensors, or CPU ones under TRITON_INTERPRET=1; otherwise it runs `lru_ensure_reference`, the same
step in plain torch (any T, any device, syncs). The two agree bit for bit.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from freetoken.runtime.moe.policy import quota
from freetoken.runtime.triton_support import kernel_runs_on, next_pow2

MAX_KERNEL_PAIRS = 128  # T·K: the per-pair [P, P] comparison matrices live in registers
MAX_KERNEL_EXPERTS = 1024
MAX_SCAN_BLOCK = 1024  # slots per step of the victim scan


@functools.cache
def _body() -> tuple[ModuleType, bool]:
    """(the kernel module, whether Triton's interpreter runs it)."""
    from triton.runtime.interpreter import InterpretedFunction

    from freetoken.runtime.moe.kernels import lru_ensure_triton as body

    return body, isinstance(body.lru_ensure_kernel, InterpretedFunction)


def lru_kernel_available(device: torch.device | str) -> bool:
    """Whether the LRU kernel runs on tensors of `device`: CUDA ones, or CPU ones under TRITON_INTERPRET=1
    (set before Triton is first imported)."""
    return kernel_runs_on(_body, device)


def _check(
    ids: torch.Tensor,
    weights: torch.Tensor,
    row: int,
    slot_of: torch.Tensor,
    owner: torch.Tensor,
    stamp: torch.Tensor,
    clock: torch.Tensor,
    fetch: torch.Tensor,
    counters: torch.Tensor,
    slot_ids: torch.Tensor,
    plan: torch.Tensor,
    count: torch.Tensor,
) -> None:
    """Shapes, dtypes, contiguity and one device: metadata only, no sync."""
    if ids.dim() != 2 or weights.shape != ids.shape or slot_ids.shape != ids.shape:
        raise ValueError(f"ids, weights and slot_ids must be one [T, K] shape, not {tuple(ids.shape)}")
    layers = slot_of.shape[0]
    expected = {
        "ids": (ids, torch.int64, None),
        "slot_of": (slot_of, torch.int32, 2),
        "owner": (owner, torch.int32, 1),
        "stamp": (stamp, torch.int64, 1),
        "clock": (clock, torch.int64, 1),
        "fetch": (fetch, torch.float32, 1),
        "counters": (counters, torch.int64, 2),
        "slot_ids": (slot_ids, torch.int64, None),
        "plan": (plan, torch.int32, 2),
        "count": (count, torch.int32, 1),
    }
    for name, (t, dtype, dims) in expected.items():
        if t.dtype != dtype or (dims is not None and t.dim() != dims) or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dtype} tensor, not {t.dtype} {tuple(t.shape)}")
        if t.device != ids.device:
            raise ValueError(f"{name} is on {t.device}, ids on {ids.device}")
    if not weights.dtype.is_floating_point or weights.device != ids.device or not weights.is_contiguous():
        raise ValueError(f"weights must be a contiguous float tensor on {ids.device}, not {weights.dtype}")
    if stamp.shape != owner.shape or clock.numel() != 1 or count.numel() != 1:
        raise ValueError("owner and stamp must be [S]; clock and count [1]")
    if fetch.shape != (layers,) or counters.shape != (layers, 5):
        raise ValueError(f"fetch must be [{layers}] and counters [{layers}, 5]")
    if plan.shape[1] != 2 or plan.shape[0] < ids.numel():
        raise ValueError(f"plan must be [P, 2] with P >= {ids.numel()}, not {tuple(plan.shape)}")
    if not 0 <= row < layers:
        raise ValueError(f"row must be in [0, {layers}), not {row}")


def use_lru_kernel(ids: torch.Tensor, num_experts: int) -> bool:
    """Whether a step of these ids runs the kernel: decode-sized, on a device the kernel runs on."""
    return (
        ids.numel() <= MAX_KERNEL_PAIRS
        and num_experts <= MAX_KERNEL_EXPERTS
        and lru_kernel_available(ids.device)
    )


def lru_ensure(
    ids: torch.Tensor,
    weights: torch.Tensor,
    row: int,
    slot_of: torch.Tensor,
    owner: torch.Tensor,
    stamp: torch.Tensor,
    clock: torch.Tensor,
    fetch: torch.Tensor,
    max_fetch: int,
    counters: torch.Tensor,
    slot_ids: torch.Tensor,
    plan: torch.Tensor,
    count: torch.Tensor,
) -> None:
    """One layer step of the LRU (see the module's note): ids, weights [T, K]; slot_ids [T, K] int64,
    plan [P, 2] int32 (P >= T·K) and count [1] int32 out; the state in place."""
    _check(ids, weights, row, slot_of, owner, stamp, clock, fetch, counters, slot_ids, plan, count)
    num_experts = slot_of.shape[1]
    if owner.shape[0] == 0 or not use_lru_kernel(ids, num_experts):  # no slot: nothing to plan
        lru_ensure_reference(
            ids, weights, row, slot_of, owner, stamp, clock, fetch, max_fetch, counters, slot_ids, plan, count
        )
        return
    pairs = ids.numel()
    slots = owner.shape[0]
    plan_rows = plan.shape[0]
    body, interpreted = _body()
    block_p = next_pow2(pairs)
    body.lru_ensure_kernel[(1,)](
        ids, weights, slot_of, owner, stamp, clock, fetch, counters, slot_ids, plan, count,
        row, max(1, min(max_fetch, pairs)),
        N=pairs, E=num_experts, S=slots, P=plan_rows, BLOCK_P=block_p,
        BLOCK_S=min(next_pow2(slots), MAX_SCAN_BLOCK), BLOCK_F=min(next_pow2(plan_rows), MAX_SCAN_BLOCK),
        COMPILED=not interpreted,
        num_warps=max(4, block_p // 8),  # sm_90 ptxas: no spills up to 64 pairs, ~2 KB at 128 (16 warps)
    )  # fmt: skip


def lru_ensure_reference(
    ids: torch.Tensor,
    weights: torch.Tensor,
    row: int,
    slot_of: torch.Tensor,
    owner: torch.Tensor,
    stamp: torch.Tensor,
    clock: torch.Tensor,
    fetch: torch.Tensor,
    max_fetch: int,
    counters: torch.Tensor,
    slot_ids: torch.Tensor,
    plan: torch.Tensor,
    count: torch.Tensor,
) -> None:
    """The kernel's step in plain torch, on any device and any T (syncs)."""
    device = ids.device
    num_experts = slot_of.shape[1]
    num_slots = owner.shape[0]
    flat_ids = ids.reshape(-1)
    valid = flat_ids >= 0
    experts, inverse, tokens = torch.unique(flat_ids[valid], return_inverse=True, return_counts=True)  # [D]
    wsum = torch.zeros(len(experts), dtype=torch.float64, device=device)
    wsum.index_add_(0, inverse, weights.reshape(-1)[valid].to(torch.float64))  # [D]
    slots = slot_of[row, experts].long()  # [D]
    hit = slots >= 0
    clock0 = int(clock.item())
    n_hits = int(hit.sum().item())
    stamp[slots[hit]] = clock0 + torch.arange(n_hits, device=device)  # experts ascend, so do the stamps

    misses = experts[~hit]  # [m], ascending
    m = len(misses)
    q = quota(m, float(fetch[row].item()), max_fetch)
    q = min(q, num_slots - n_hits)
    by_weight = torch.sort(wsum[~hit], descending=True, stable=True).indices  # ties keep ascending id
    by_tokens = torch.sort(tokens[~hit][by_weight], descending=True, stable=True).indices
    chosen = torch.sort(misses[by_weight[by_tokens[:q]]]).values  # [q], admission order

    keys = (stamp + 1) * num_slots + torch.arange(num_slots, device=device)  # [S], unique
    keys = torch.where(stamp < clock0, keys, torch.iinfo(torch.int64).max)
    victims = torch.topk(keys, q, largest=False).indices  # [q], oldest first (keys are unique)
    old = owner[victims].long()  # [q]
    evicted = old >= 0
    slot_of.view(-1)[old[evicted]] = -1
    slot_of[row, chosen] = victims.to(torch.int32)
    owner[victims] = (row * num_experts + chosen).to(torch.int32)
    stamp[victims] = clock0 + n_hits + torch.arange(q, device=device)
    plan.fill_(-1)
    plan[:q, 0] = chosen.to(torch.int32)
    plan[:q, 1] = victims.to(torch.int32)

    n_evicted = int(evicted.sum().item())
    clock.fill_(clock0 + n_hits + q)
    count.fill_(q)
    counters[row] += torch.tensor([n_hits, m, q, n_evicted, m - q], dtype=torch.int64, device=device)
    resident = slot_of[row, ids.clamp(min=0)].long()  # [T, K]
    slot_ids.copy_(torch.where(ids >= 0, resident, -1))
