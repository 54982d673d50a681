"""RMSNorm (plain and fused with the residual add) and rotary embedding: torch references and
Triton kernels.

The references are the model's own arithmetic (`runtime/models/layers.py`): RMSNorm normalizes in
float32, rounds to the activation dtype, then multiplies by the weight; rotary embedding is the
"rotate half" (GPT-NeoX) form with cos/sin rows `[T, head_dim]` already in the activation dtype.
"""

from __future__ import annotations

import torch

from plait.kernels.dispatch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # Linux-only wheels; the torch references need nothing else
    triton = None


# torch references ----------------------------------------------------------------------------


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden], as `llama.RMSNorm`."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the sum is rounded to the activation dtype
    first, exactly as `residual = residual + x` in the unfused model."""
    summed = x + residual  # [T, hidden]
    return rms_norm_ref(summed, weight, eps), summed


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos, sin [T, head_dim], as `llama.apply_rotary`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


# Triton kernels ------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        x_stride,
        residual_ptr,
        residual_stride,
        weight_ptr,
        out_ptr,
        out_stride,
        hidden,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # grid: (tokens,); one program normalizes one row
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # rounded as the model rounds it
            tl.store(residual_ptr + row * residual_stride + cols, x, mask=mask)
        xf = x.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
        normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(
            out_ptr + row * out_stride + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask
        )

    @triton.jit
    def _rotary_kernel(
        x_ptr,
        x_stride_t,
        x_stride_h,
        cos_ptr,
        sin_ptr,
        cs_stride,
        num_heads,
        HALF: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
    ):
        # grid: (tokens, head blocks); in place on [BLOCK_H heads, head_dim] of one token
        t = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_HALF)
        mask = (heads[:, None] < num_heads) & (d[None, :] < HALF)
        base = x_ptr + t * x_stride_t + heads[:, None] * x_stride_h + d[None, :]
        x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_HALF]
        x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
        cos1 = tl.load(cos_ptr + t * cs_stride + d, mask=d < HALF, other=0.0).to(tl.float32)[
            None, :
        ]
        cos2 = tl.load(cos_ptr + t * cs_stride + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[
            None, :
        ]
        sin1 = tl.load(sin_ptr + t * cs_stride + d, mask=d < HALF, other=0.0).to(tl.float32)[
            None, :
        ]
        sin2 = tl.load(sin_ptr + t * cs_stride + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[
            None, :
        ]
        out_dtype = x_ptr.dtype.element_ty
        tl.store(base, (x1 * cos1 - x2 * sin1).to(out_dtype), mask=mask)
        tl.store(base + HALF, (x2 * cos2 + x1 * sin2).to(out_dtype), mask=mask)


def _rms_norm_launch(x, residual, weight, eps, out):
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return
    for name, t in (("x", x), ("residual", residual), ("out", out)):
        if t is not None and (t.dim() != 2 or t.stride(1) != 1 or t.shape != x.shape):
            raise ValueError(f"rms_norm_triton: {name} must be [T, hidden] with contiguous rows")
    launch(
        _rms_norm_kernel,
        (num_tokens,),
        x,
        x,
        x.stride(0),
        residual if residual is not None else x,
        residual.stride(0) if residual is not None else 0,
        weight,
        out,
        out.stride(0),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(hidden),
        num_warps=max(1, min(16, triton.next_power_of_2(hidden) // 256)),
    )


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `rms_norm_ref` (the output has the activation dtype)."""
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _rms_norm_launch(x, None, weight, eps, out)
    return out


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `fused_add_rms_norm_ref`, one pass over memory; `residual` is updated in
    place to x + residual and returned as the second value."""
    if residual.dtype != x.dtype:
        raise ValueError(f"fused_add_rms_norm_triton: residual is {residual.dtype}, x is {x.dtype}")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _rms_norm_launch(x, residual, weight, eps, out)
    return out, residual


def rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In place on x [T, heads, head_dim] (a strided view of a fused qkv buffer is fine); returns
    x. Same values as `rotary_ref`, computed in float32 and rounded once."""
    num_tokens, num_heads, head_dim = x.shape
    if (
        x.stride(2) != 1
        or cos.stride(1) != 1
        or sin.stride(1) != 1
        or cos.stride(0) != sin.stride(0)
    ):
        raise ValueError("rotary_triton: head_dim must be contiguous in x, cos and sin")
    if head_dim % 2 or cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(
            f"rotary_triton: x {tuple(x.shape)} needs an even head_dim and cos/sin "
            f"[{num_tokens}, {head_dim}]"
        )
    if num_tokens == 0:
        return x
    half = head_dim // 2
    block_h = min(triton.next_power_of_2(num_heads), 16)
    launch(
        _rotary_kernel,
        (num_tokens, triton.cdiv(num_heads, block_h)),
        x,
        x,
        x.stride(0),
        x.stride(1),
        cos,
        sin,
        cos.stride(0),
        num_heads,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,
    )
    return x
