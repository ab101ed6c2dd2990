"""The decode step's norms and rotary as Triton launches, with no host sync (graph-capturable):

- `add_rms_norm`: the residual add and the RMSNorm after it, in one pass over [B, H];
- `qk_norm_rope_kv_write`: per-head q/k RMSNorm (where the model has it; plain or zero-centred), rotary
  on the first rotary dims of q and k, and the k/v cache write at each row's (slot, position), in one
  launch.

Each matches its reference beside it (`layers.RMSNorm` and `rope.apply_rotary` as the model runs them)
bit for bit up to the fp32 sum of squares and rsqrt (on CPU under the interpreter they agree exactly in
practice; compiled, expect rare 1-ulp differences in the model dtype).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from freetoken.runtime.models.kernels.decode_attention import check_device
from freetoken.runtime.models.rope import partial_rotary
from freetoken.runtime.triton_support import next_pow2


@functools.cache
def _body() -> tuple[ModuleType, bool]:
    """(the kernel module, whether Triton's interpreter runs it)."""
    from triton.runtime.interpreter import InterpretedFunction

    from freetoken.runtime.models.kernels import norm_rope_triton as body

    return body, isinstance(body.add_rms_norm_kernel, InterpretedFunction)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    zero_centred: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [B, H] (rows contiguous), weight [H], all in one dtype -> (normed, summed) [B, H]:
    summed = x + residual (x itself without a residual), normed = RMSNorm(summed) (`zero_centred`: the
    weight scales by 1 + w, Qwen3.5's norms)."""
    b, h = x.shape
    if weight.shape != (h,) or weight.dtype != x.dtype:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} does not fit x [{b}, {h}] {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not fit x")
    check_device(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    normed = torch.empty(b, h, dtype=x.dtype, device=x.device)
    summed = x if residual is None else torch.empty_like(normed)
    if b == 0:
        return normed, summed
    block = next_pow2(h)
    body, interpreted = _body()
    body.add_rms_norm_kernel[(b,)](
        x, x if residual is None else residual, weight.contiguous(), normed, summed,
        x.stride(0), 0 if residual is None else residual.stride(0), eps,
        H=h, BLOCK=block, HAS_RESIDUAL=residual is not None, ZERO_CENTRED=zero_centred,
        COMPILED=not interpreted,
        num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return normed, summed


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.RMSNorm.forward: normalise in fp32, round to the dtype, scale in the dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    zero_centred: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x if residual is None else x + residual
    norm = zero_centred_rms_norm_reference if zero_centred else rms_norm_reference
    return norm(summed, weight, eps), summed


def _check_rows(name: str, t: torch.Tensor, b: int, width: int) -> None:
    if t.dim() != 2 or t.shape != (b, width) or t.stride(-1) != 1:
        raise ValueError(f"{name} must be [{b}, {width}] with contiguous rows, not {tuple(t.shape)}")


def qk_norm_rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    zero_centred: bool = False,
) -> torch.Tensor:
    """q [B, NH*D] or [B, NH, D] (row and head strides free, D contiguous: views into one projection are
    fine), k, v [B, KVH*D] (row strides free, columns contiguous), norm weights [D] (both None: no q/k norm;
    `zero_centred`: they scale by 1 + w, Qwen3.5's), cos, sin [B, R] (rows contiguous): rotary on the first
    R <= D dims of each head, the rest passed through; caches [S, KVH, CAP, D] (D contiguous, same
    strides); slots, positions [B] int32 -> q rotated [B, NH, D] (contiguous). Writes rotated k and raw v
    at [slots[b], :, positions[b]] for every row with slots[b] >= 0 (a position outside [0, CAP) writes
    nothing: checking it on the host would sync). Activations, weights and caches in one dtype."""
    d, rot = k_cache.shape[-1], cos.shape[-1]
    b = q.shape[0]
    nh, kvh = _heads(q, d), k.shape[1] // d
    norm = q_norm_weight is not None
    if norm and (q_norm_weight.shape != (d,) or k_norm_weight is None or k_norm_weight.shape != (d,)):
        raise ValueError(f"q/k norm weights must be [{d}] each (or both None)")
    if rot % 2 or rot > d or k.shape[1] != kvh * d:
        raise ValueError(
            f"q {tuple(q.shape)} / k {tuple(k.shape)} do not split into heads of {d} roped on {rot}"
        )
    widths = {"k": (k, kvh * d), "v": (v, kvh * d), "cos": (cos, rot), "sin": (sin, rot)}
    for name, (t, width) in widths.items():
        _check_rows(name, t, b, width)
    if k_cache.shape[1] != kvh or k_cache.stride(-1) != 1:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not fit {kvh} KV heads of {d}")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k and v caches need one shape and one layout")
    if any(t.dtype != torch.int32 or t.shape != (b,) for t in (slots, positions)):
        raise ValueError("slots and positions must be int32 vectors of one entry per row")
    weights = (q_norm_weight, k_norm_weight) if norm else ()
    others = (k, v, *weights, cos, sin, k_cache, v_cache)
    if any(t.dtype != q.dtype for t in others):
        found = sorted({str(t.dtype) for t in (q, *others)})
        raise ValueError(f"activations, weights, cos/sin and caches need one dtype, not {found}")
    check_device(q)
    q_out = torch.empty(b, nh, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return q_out
    stride_qh = d if q.dim() == 2 else q.stride(1)
    body, interpreted = _body()
    body.qk_norm_rope_kv_write_kernel[(b, nh + kvh)](
        q, k, v, *(w.contiguous() for w in weights or (q, q)), cos, sin, k_cache, v_cache,
        slots, positions, q_out, q.stride(0), stride_qh, k.stride(0), v.stride(0), cos.stride(0),
        sin.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), eps, k_cache.shape[2],
        NH=nh, D=d, HALF=rot // 2, REST=d - rot, BLOCK=next_pow2(rot // 2), BLOCK_R=next_pow2(d - rot),
        NORM=norm, ZERO_CENTRED=zero_centred, COMPILED=not interpreted, num_warps=1,
        enable_fp_fusion=False,  # keep x*cos + r*sin two roundings, as torch computes it (fp32 models)
    )  # fmt: skip
    return q_out


def _heads(q: torch.Tensor, d: int) -> int:
    """Query heads of q [B, NH*D] or [B, NH, D] (D contiguous)."""
    if q.dim() == 3 and q.shape[2] == d and q.stride(2) == 1:
        return q.shape[1]
    if q.dim() == 2 and q.shape[1] % d == 0 and q.stride(1) == 1:
        return q.shape[1] // d
    raise ValueError(f"q {tuple(q.shape)} does not split into heads of {d}")


def zero_centred_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's ZeroCenteredRMSNorm: x̂·(1 + w) in fp32, rounded once."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def qk_norm_rope_kv_write_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    zero_centred: bool = False,
) -> torch.Tensor:
    """The oracle: the eager attention's q/k norm (none when the weights are None) and rotary on the first
    cos.shape[-1] dims, then the cache writes, in plain torch."""
    d = k_cache.shape[-1]
    b = q.shape[0]
    qh, kh = q.reshape(b, -1, d), k.reshape(b, -1, d)
    if q_norm_weight is not None and k_norm_weight is not None:
        norm = zero_centred_rms_norm_reference if zero_centred else rms_norm_reference
        qh, kh = norm(qh, q_norm_weight, eps), norm(kh, k_norm_weight, eps)
    qh, kh = qh.transpose(0, 1), kh.transpose(0, 1)  # [NH, B, D], [KVH, B, D]
    q_rot, k_rot = partial_rotary(qh, cos, sin), partial_rotary(kh, cos, sin)
    live = slots >= 0
    at_slot, at_pos = slots[live].long(), positions[live].long()
    k_cache[at_slot, :, at_pos] = k_rot.transpose(0, 1)[live]  # [M, KVH, D]
    v_cache[at_slot, :, at_pos] = v.reshape(b, -1, d)[live]
    return q_rot.transpose(0, 1).contiguous()  # [B, NH, D]
