"""Dequantisers in torch for every GGML type the device keeps as stored: rows of blocks on any device, for
steps too large for the fused decode kernel (dequantise the used experts, then a plain GEMM) and for the
cpu device standing in for an accelerator. Q8_0, Q4_K, Q6_K and MXFP4 here; the others in torch_lowbit.py.
The reference each is tested against is the codec's `dequantize` (gguf's)."""

from __future__ import annotations

import torch

from freetoken.codecs.torch_lowbit import DECODERS
from freetoken.codecs.torch_lowbit import half as _half

DEVICE_CODECS = ("Q8_0", "Q4_K", "Q6_K", "MXFP4", *DECODERS)
_MXFP4_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _shifts(bits: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Shift amounts along the second-to-last dim, uint8 [len(bits), 1]."""
    return torch.tensor(bits, dtype=torch.uint8, device=device).reshape(-1, 1)


def dequantize_rows(raw: torch.Tensor, codec: str, elements: int) -> torch.Tensor:
    """raw uint8 [..., row bytes] -> float32 [..., elements] on raw's device."""
    lead = raw.shape[:-1]
    if codec == "Q8_0":
        b = raw.reshape(*lead, elements // 32, 34)
        q = b[..., 2:].contiguous().view(torch.int8).float()  # [..., nb, 32]
        return (_half(b[..., :2])[..., None] * q).reshape(*lead, elements)
    if codec == "Q4_K":
        b = raw.reshape(*lead, elements // 256, 144)
        d, dmin = _half(b[..., 0:2])[..., None], _half(b[..., 2:4])[..., None]
        s = b[..., 4:16].to(torch.int32)
        lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
        sc = torch.cat((lo & 63, (hi & 15) | ((lo >> 2) & 48)), dim=-1).float()  # [..., nb, 8]
        mn = torch.cat((mid & 63, (hi >> 4) | ((mid >> 2) & 48)), dim=-1).float()
        qs = b[..., 16:].reshape(*lead, elements // 256, 4, 32)
        q = torch.stack((qs & 15, qs >> 4), dim=-2).reshape(*lead, elements // 256, 8, 32).float()
        return (d[..., None] * sc[..., None] * q - dmin[..., None] * mn[..., None]).reshape(*lead, elements)
    if codec == "Q6_K":  # 210-byte super-blocks: 128 bytes of low nibbles, 64 of 2-bit highs, 16 scales, d
        b = raw.reshape(*lead, elements // 256, 210)
        ql = b[..., :128].reshape(*lead, elements // 256, 2, 1, 64) >> _shifts((0, 4), raw.device)
        ql = (ql & 15).reshape(*lead, elements // 256, 8, 32)  # [..., nb, half·4 + group, 32]
        qh = b[..., 128:192].reshape(*lead, elements // 256, 2, 1, 32) >> _shifts((0, 2, 4, 6), raw.device)
        qh = (qh & 3).reshape(*lead, elements // 256, 8, 32)
        q = ((ql | (qh << 4)).to(torch.int32) - 32).reshape(*lead, elements // 256, 16, 16).float()
        scales = b[..., 192:208].contiguous().view(torch.int8).float()  # [..., nb, 16]
        d = _half(b[..., 208:210])[..., None]
        return (d[..., None] * scales[..., None] * q).reshape(*lead, elements)
    if codec == "MXFP4":
        b = raw.reshape(*lead, elements // 32, 17)
        qs = b[..., 1:]
        codes = torch.cat((qs & 15, qs >> 4), dim=-1).long()  # [..., nb, 32]: low nibbles first
        table = torch.tensor(_MXFP4_DOUBLED, dtype=torch.float32, device=raw.device)
        exponent = b[..., :1].to(torch.int32) - 128  # [..., nb, 1]
        scale = torch.ldexp(torch.ones(exponent.shape, device=raw.device), exponent)
        return (table[codes] * scale).reshape(*lead, elements)
    if codec in DECODERS:
        block_bytes, decode = DECODERS[codec]
        blocks = raw.shape[-1] // block_bytes
        return decode(raw.reshape(*lead, blocks, block_bytes)).reshape(*lead, elements)
    raise ValueError(f"no torch dequantiser for {codec}; these have one: {', '.join(DEVICE_CODECS)}")
