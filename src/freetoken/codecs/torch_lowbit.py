"""Torch dequantisers of the GGML types beyond the first four the device kept (torch_dequant.py): the legacy
32-weight types (Q4_0, Q5_0, IQ4_NL), the K-quants Q2_K, Q3_K, Q5_K, and the codebook types IQ4_XS,
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ3_S, and the safetensors codecs FP8 and NVFP4. Layouts as lowbit_dot.h's
header comment (FP8's and NVFP4's: codecs/fp8.py, codecs/nvfp4.py); each matches gguf's
`dequantize` bit for bit (tests/codecs/test_torch_dequant.py). `b` is uint8 [..., blocks, block bytes]."""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
E2M1_VALUES = (0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6)


def half(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] fp32 (little-endian fp16)."""
    return raw.contiguous().view(torch.float16)[..., 0].float()


def word(raw: torch.Tensor) -> torch.Tensor:
    """[..., 4] uint8 -> [...] int64 (little-endian uint32)."""
    r = raw.to(torch.int64)
    return r[..., 0] | (r[..., 1] << 8) | (r[..., 2] << 16) | (r[..., 3] << 24)


def bits(raw: torch.Tensor, count: int, step: int = 1) -> torch.Tensor:
    """Each value's `count` fields of `step` bits, lowest first: [...] -> [..., count] int64."""
    shifts = torch.arange(0, count * step, step, device=raw.device)
    return (raw.to(torch.int64)[..., None] >> shifts) & ((1 << step) - 1)


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] int64: the low nibbles then the high ones (weights j and j + 16)."""
    q = qs.to(torch.int64)
    return torch.cat((q & 15, q >> 4), dim=-1)


@cache
def _tables(device: torch.device) -> dict[str, torch.Tensor]:
    import gguf.quants as gq

    out = {"ksigns": torch.from_numpy(np.frombuffer(gq.IQ2_XXS.ksigns, np.uint8).copy()).to(device)}
    for cls in (gq.IQ2_XXS, gq.IQ2_XS, gq.IQ3_XXS, gq.IQ3_S):
        cls.init_grid()
        grid = np.asarray(cls.grid, np.float32).reshape(cls.grid_shape)
        out[cls.__name__] = torch.from_numpy(grid).to(device)
    out["IQ4_NL"] = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32, device=device)
    return out


def _signed(grid: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Grid values [..., 8] negated where the sign bytes [...] have bit j set."""
    return torch.where(bits(signs, 8).bool(), -grid, grid)


def legacy(b: torch.Tensor, codec: str) -> torch.Tensor:
    """Q4_0, Q5_0, IQ4_NL, Q4_1, Q5_1 blocks of 32 -> [..., blocks, 32]."""
    d = half(b[..., :2])[..., None]
    if codec == "Q5_0":
        high = bits(word(b[..., 2:6]), 32)
        return d * ((nibbles(b[..., 6:]) | (high << 4)) - 16).float()
    if codec in ("Q4_1", "Q5_1"):  # w = d·q + m
        offset = half(b[..., 2:4])[..., None]
        q = (
            nibbles(b[..., 4:])
            if codec == "Q4_1"
            else nibbles(b[..., 8:]) | (bits(word(b[..., 4:8]), 32) << 4)
        )
        return d * q.float() + offset
    q = nibbles(b[..., 2:])
    if codec == "IQ4_NL":
        return d * _tables(b.device)["IQ4_NL"][q]
    return d * (q - 8).float()


def q2_k(b: torch.Tensor) -> torch.Tensor:
    sc = b[..., :16].to(torch.int64)
    d, dmin = half(b[..., 80:82])[..., None], half(b[..., 82:84])[..., None]
    q = bits(b[..., 16:80].reshape(*b.shape[:-1], 2, 32), 4, 2)  # [..., g, l, s]
    q = q.transpose(-1, -2).reshape(*b.shape[:-1], 16, 16)  # weight 128g + 32s + l
    return (d[..., None] * (sc & 15)[..., None] * q - dmin[..., None] * (sc >> 4)[..., None]).flatten(-2)


def q3_k(b: torch.Tensor) -> torch.Tensor:
    sc = b[..., 96:108]
    low = torch.cat((sc[..., :8] & 15, sc[..., :8] >> 4), dim=-1).to(torch.int64)  # scale s: byte s % 8
    high = bits(sc[..., 8:12], 4, 2).transpose(-1, -2).flatten(-2)  # scale s: byte s % 4, bits 2(s // 4)
    scales = ((low | (high << 4)) - 32).float()  # [..., 16]
    q = bits(b[..., 32:96].reshape(*b.shape[:-1], 2, 32), 4, 2).transpose(-1, -2).flatten(-3)  # [..., 256]
    h = bits(b[..., :32], 8).transpose(-1, -2).flatten(-2)  # weight 32s + l: hmask[l] bit s
    w = (q - 4 * (1 - h)).float().reshape(*b.shape[:-1], 16, 16)
    return (half(b[..., 108:110])[..., None, None] * scales[..., None] * w).flatten(-2)


def q5_k(b: torch.Tensor) -> torch.Tensor:
    s = b[..., 4:16].to(torch.int64)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((lo & 63, (hi & 15) | ((lo >> 2) & 48)), dim=-1).float()  # [..., 8]
    mn = torch.cat((mid & 63, (hi >> 4) | ((mid >> 2) & 48)), dim=-1).float()
    qs = b[..., 48:].reshape(*b.shape[:-1], 4, 32).to(torch.int64)
    low = torch.stack((qs & 15, qs >> 4), dim=-2).reshape(*b.shape[:-1], 8, 32)  # sub-block 2c + half
    high = bits(b[..., 16:48], 8).transpose(-1, -2)  # [..., 8, 32]: sub-block j's fifth bits
    q = (low | (high << 4)).float()
    d, dmin = half(b[..., 0:2])[..., None, None], half(b[..., 2:4])[..., None, None]
    return (d * sc[..., None] * q - dmin * mn[..., None]).flatten(-2)


def iq4_xs(b: torch.Tensor) -> torch.Tensor:
    low = bits(b[..., 4:8], 2, 4).flatten(-2)  # sub-block j: scales_l byte j // 2, nibble j % 2
    high = bits(b[..., 2].to(torch.int64) | (b[..., 3].to(torch.int64) << 8), 8, 2)
    ls = ((low | (high << 4)) - 32).float()  # [..., 8]
    q = nibbles(b[..., 8:].reshape(*b.shape[:-1], 8, 16))  # [..., 8, 32]
    return (half(b[..., :2])[..., None, None] * ls[..., None] * _tables(b.device)["IQ4_NL"][q]).flatten(-2)


def iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    t = _tables(b.device)
    pairs = b[..., 2:].reshape(*b.shape[:-1], 8, 2, 4)
    grid = t["IQ2_XXS"][pairs[..., 0, :].to(torch.int64)]  # [..., 8, 4, 8]
    aux = word(pairs[..., 1, :])  # [..., 8]
    signs = t["ksigns"][bits(aux, 4, 7)]  # [..., 8, 4]
    db = half(b[..., :2])[..., None] * (0.5 + (aux >> 28).float()) * 0.25
    return (db[..., None, None] * _signed(grid, signs)).flatten(-3)


def iq2_xs(b: torch.Tensor) -> torch.Tensor:
    t = _tables(b.device)
    qs = b[..., 2:66].reshape(*b.shape[:-1], 32, 2).to(torch.int64)
    q = qs[..., 0] | (qs[..., 1] << 8)  # [..., 32]
    grid = _signed(t["IQ2_XS"][q & 511], t["ksigns"][q >> 9])  # [..., 32, 8]
    ls = bits(b[..., 66:74], 2, 4).flatten(-2).repeat_interleave(2, dim=-1)  # [..., 32]: group i's scale
    db = half(b[..., :2])[..., None] * (0.5 + ls.float()) * 0.25
    return (db[..., None] * grid).flatten(-2)


def iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    t = _tables(b.device)
    grid = t["IQ3_XXS"][b[..., 2:66].to(torch.int64)].reshape(*b.shape[:-1], 8, 4, 8)
    aux = word(b[..., 66:98].reshape(*b.shape[:-1], 8, 4))  # [..., 8]
    signs = t["ksigns"][bits(aux, 4, 7)]
    db = half(b[..., :2])[..., None] * (0.5 + (aux >> 28).float()) * 0.5
    return (db[..., None, None] * _signed(grid, signs)).flatten(-3)


def iq3_s(b: torch.Tensor) -> torch.Tensor:
    t = _tables(b.device)
    index = b[..., 2:66].to(torch.int64) | (bits(b[..., 66:74], 8).flatten(-2) << 8)  # [..., 64]
    grid = t["IQ3_S"][index].reshape(*b.shape[:-1], 32, 8)
    ls = bits(b[..., 106:110], 2, 4).flatten(-2).repeat_interleave(4, dim=-1)  # [..., 32]
    db = half(b[..., :2])[..., None] * (1 + 2 * ls).float()
    return (db[..., None] * _signed(grid, b[..., 74:106])).flatten(-2)


def e4m3(raw: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 codes -> fp32."""
    return raw.contiguous().view(torch.float8_e4m3fn).float()


def fp8(b: torch.Tensor) -> torch.Tensor:
    """FP8 rows' blocks (codecs/fp8.py: an fp32 scale, 128 e4m3) -> [..., blocks, 128]."""
    return b[..., :4].contiguous().view(torch.float32) * e4m3(b[..., 4:])


def nvfp4(b: torch.Tensor) -> torch.Tensor:
    """NVFP4 rows' blocks (codecs/nvfp4.py: an fp32 multiplier, eight e4m3 scales, 64 bytes of e2m1 codes,
    weights i and i + 8 of each 16 in byte i's low and high nibble) -> [..., blocks, 128]."""
    scale = e4m3(b[..., 4:12]) * b[..., :4].contiguous().view(torch.float32)  # [..., blocks, 8]
    codes = b[..., 12:].reshape(*b.shape[:-1], 8, 8).to(torch.int64)
    codes = torch.cat((codes & 15, codes >> 4), dim=-1)  # [..., blocks, 8, 16]
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=b.device)
    return (table[codes] * scale[..., None]).flatten(-2)


# codec -> (bytes per block, the block decoder)
DECODERS = {
    "Q4_0": (18, lambda b: legacy(b, "Q4_0")),
    "Q5_0": (22, lambda b: legacy(b, "Q5_0")),
    "IQ4_NL": (18, lambda b: legacy(b, "IQ4_NL")),
    "Q4_1": (20, lambda b: legacy(b, "Q4_1")),
    "Q5_1": (24, lambda b: legacy(b, "Q5_1")),
    "Q2_K": (84, q2_k),
    "Q3_K": (110, q3_k),
    "Q5_K": (176, q5_k),
    "IQ4_XS": (136, iq4_xs),
    "IQ2_XXS": (66, iq2_xxs),
    "IQ2_XS": (74, iq2_xs),
    "IQ3_XXS": (98, iq3_xxs),
    "IQ3_S": (110, iq3_s),
    "FP8": (132, fp8),
    "NVFP4": (76, nvfp4),
}
