"""Weight quantization kernels: block-wise FP8 (DeepSeek layout) and group-wise INT4 (compressed-tensors).

FP8 E4M3, 128x128 blocks, fp32 scales: `scale_inv[i, j] = amax(block) / 448`, stored as
`<name>.weight_scale_inv` so that `w ~= fp8 * scale_inv` (DeepSeek-V3 / SGLang convention).

INT4 symmetric, one scale per `group_size` input columns, compressed-tensors `pack-quantized`:
`weight_packed` int32 [out, in/8] holds 8 nibbles (value + 8, nibble i at bits 4i),
`weight_scale` [out, in/group_size] in the weight's dtype, `weight_shape` int64 [2].
The grid is Miles' fake-QAT grid: `scale = max(amax / 7, 1e-5)`, `q = clamp(round(w/scale), -7, 7)`,
so a QAT-trained weight (`fake_int4_quant`) packs without further rounding error.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = 128
INT4_QMAX = 7
INT4_MIN_SCALE = 1e-5
PACK_FACTOR = 8  # int4 values per int32


# ---- FP8 block-wise --------------------------------------------------------------------------


def _scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-d fp32 tensor on `like`'s device: dividing by it is a true division on every device."""
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def _pad_to_blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    rows, cols = w.shape
    pr, pc = (-rows) % block, (-cols) % block
    return torch.nn.functional.pad(w, (0, pc, 0, pr)) if pr or pc else w


def fp8_block_quant(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D weight -> (float8_e4m3fn weight of the same shape, fp32 scale_inv [ceil(r/b), ceil(c/b)])."""
    if w.dim() != 2:
        raise ValueError(f"fp8_block_quant: expected a 2-D weight, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    x = _pad_to_blocks(w.float(), block)
    br, bc = x.shape[0] // block, x.shape[1] // block
    blocks = x.reshape(br, block, bc, block)
    amax = blocks.abs().amax(dim=(1, 3))
    # a tensor divisor: CUDA turns `x / python_float` into `x * (1/float)`, 1 ulp off the CPU result
    scale_inv = (amax / _scalar(FP8_MAX, amax)).clamp_min(torch.finfo(torch.float32).tiny)
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(br * block, bc * block)[:rows, :cols].contiguous(), scale_inv


def fp8_block_dequant(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32, block: int = FP8_BLOCK
) -> torch.Tensor:
    rows, cols = q.shape
    s = scale_inv.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return (q.float() * s).to(dtype)


# ---- INT4 group-wise -------------------------------------------------------------------------


def int4_group_size(in_features: int, group_size: int = 128) -> int:
    """The group size actually used: clamped to in_features; must divide it."""
    g = min(group_size, in_features)
    if in_features % g or g % PACK_FACTOR:
        raise ValueError(
            f"int4: in_features {in_features} is not divisible by group_size {g} (and by {PACK_FACTOR})"
        )
    return g


def int4_quant(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D weight -> (int8 values in [-7, 7] [out, in], scales [out, in/g] fp32)."""
    if w.dim() != 2:
        raise ValueError(f"int4_quant: expected a 2-D weight, got shape {tuple(w.shape)}")
    out_f, in_f = w.shape
    g = int4_group_size(in_f, group_size)
    groups = w.float().reshape(out_f, in_f // g, g)
    scale = (groups.abs().amax(-1) / _scalar(INT4_QMAX, groups)).clamp_min(INT4_MIN_SCALE)
    q = torch.round(groups / scale[..., None]).clamp(-INT4_QMAX, INT4_QMAX).to(torch.int8)
    return q.reshape(out_f, in_f), scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [-8, 7] [rows, cols] -> int32 [rows, cols/8], compressed-tensors nibble order."""
    rows, cols = q.shape
    if cols % PACK_FACTOR:
        raise ValueError(f"pack_int4: {cols} columns is not a multiple of {PACK_FACTOR}")
    u = (q.to(torch.int32) + 8).reshape(rows, cols // PACK_FACTOR, PACK_FACTOR)
    shifts = torch.arange(PACK_FACTOR, dtype=torch.int32, device=q.device) * 4
    # bitwise-or of disjoint nibbles == sum; int32 wraps for the top nibble as intended
    return (u << shifts).sum(dim=-1, dtype=torch.int32)


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    shifts = torch.arange(PACK_FACTOR, dtype=torch.int32, device=packed.device) * 4
    u = (packed[..., None] >> shifts) & 0xF
    return (u.reshape(packed.shape[0], -1)[:, :cols] - 8).to(torch.int8)


def int4_pack_quantize(w: torch.Tensor, group_size: int = 128) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized tensors for one Linear weight (suffixes only)."""
    q, scale = int4_quant(w, group_size)
    return {
        "weight_packed": pack_int4(q),
        "weight_scale": scale.to(w.dtype if w.is_floating_point() else torch.float32),
        "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64),
    }


def int4_dequant(
    packed: torch.Tensor, scale: torch.Tensor, shape, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    out_f, in_f = (int(s) for s in shape)
    q = unpack_int4(packed, in_f).float()
    g = in_f // scale.shape[1]
    return (q.reshape(out_f, -1, g) * scale.float()[..., None]).reshape(out_f, in_f).to(dtype)


# ---- INT4 fake quantization for QAT -----------------------------------------------------------


def fake_int4_quant_reference(w: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    q, scale = int4_quant(w, group_size)
    g = w.shape[1] // scale.shape[1]
    return (q.float().reshape(w.shape[0], -1, g) * scale[..., None]).reshape(w.shape).to(w.dtype)


class FakeInt4STE(torch.autograd.Function):
    """Forward: quantize-dequantize on the INT4 grid. Backward: straight-through (identity)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, group_size: int) -> torch.Tensor:
        return fake_int4_quant_reference(w, group_size)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return grad_out, None


def fake_int4_quant(w: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    return FakeInt4STE.apply(w, group_size)
