"""GPTQ's column loop over one block of columns as ONE Triton kernel (integer formats, scales
fixed before the loop: act_order or static_groups), bit for bit the loop of lowbit.algorithms.gptq.solver._solve.

Why: in PyTorch the loop is ~11 small kernels per column (the column's quantization, its error,
the update of the block's later columns), so on a GPU it is bound by launches, not arithmetic:
a Llama-8B decoder layer has 26,624 columns to visit and the rows of a weight cannot make it
shorter. Here one program owns a tile of ROWS rows x the whole block in registers and runs the
block's columns one after another with no launch in between (GPTQ's rows are independent), so
a block costs one launch and the loop scales with rows, i.e. it splits across GPUs.

Same arithmetic as the PyTorch step, element by element, which is why the result is bit-identical
(tests/algorithms/test_gptq.py runs both, in Triton's interpreter on the CPU):
  x   = W1[:, i] (float64);  y = float32(x) / s   (IEEE division: div_rn, not the fast approximate one)
  c   = clamp(round_half_even(y) [+ z], lo, hi);  q = (float64(c) [- float64(z)]) * float64(s)
  e   = (x - q) / Hinv1[i, i]  (float64 division, IEEE-rounded on the GPU too);  W1[:, j] -= e * Hinv1[i, j] for j > i
      (a product and a subtraction, two roundings: the kernel is compiled without FMA contraction)
round_half_even is lowbit.ops.triton.common.rint, exact for |y| < 2^22: y is first clamped to
+-1024, which changes no code of a format of at most 8 bits (any |y| > 1024 saturates anyway).
The column is read out of the register tile with a maximum over the row (a max of x and -inf's is
x exactly, signed zeros included).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.ops.triton.common import rint


@triton.jit
def gptq_block_kernel(w_ptr, err_ptr, s_ptr, z_ptr, h_ptr, n, b, hs0, hs1, lo, hi,
                      ASYM: tl.constexpr, ROWS: tl.constexpr, BB: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BB)
    rmask = rows < n
    tile = rmask[:, None] & (cols[None, :] < b)
    offs = rows[:, None] * b + cols[None, :]
    w = tl.load(w_ptr + offs, mask=tile, other=0.0)
    for i in range(0, b):
        x = tl.max(tl.where(cols[None, :] == i, w, float("-inf")), axis=1)
        s = tl.load(s_ptr + rows * b + i, mask=rmask, other=1.0)
        y = tl.math.div_rn(x.to(tl.float32), s)
        c = rint(tl.minimum(tl.maximum(y, -1024.0), 1024.0))
        if ASYM:
            z = tl.load(z_ptr + rows * b + i, mask=rmask, other=0).to(tl.float32)
            c = tl.minimum(tl.maximum(c + z, lo), hi)
            v = c.to(tl.float64) - z.to(tl.float64)
        else:
            c = tl.minimum(tl.maximum(c, lo), hi)
            v = c.to(tl.float64)
        q = v * s.to(tl.float64)
        d = tl.load(h_ptr + i * hs0 + i * hs1)
        e = (x - q) / d     # float64 division is IEEE-rounded (div.rn.f64); div_rn is float32-only
        tl.store(err_ptr + rows * b + i, e, mask=rmask)
        hrow = tl.load(h_ptr + i * hs0 + cols * hs1, mask=cols < b, other=0.0)
        w = tl.where(cols[None, :] > i, w - e[:, None] * hrow[None, :], w)
    tl.store(w_ptr + offs, w, mask=tile)


def run_block(W1: torch.Tensor, Err1: torch.Tensor, s1: torch.Tensor, z1: torch.Tensor | None,
              Hinv1: torch.Tensor, scheme) -> None:
    """The column loop of one block, in place: W1 [n, b] float64 contiguous (each column ends as it
    was when quantized; later columns updated), Err1 [n, b] float64 (the scaled errors), s1 [n, b]
    float32 effective scales, z1 [n, b] int32 zero points or None, Hinv1 [b, b] float64 (any
    strides: a view of the factor). Same values as lowbit.algorithms.gptq.solver._solve's PyTorch loop."""
    n, b = W1.shape
    if not (W1.is_contiguous() and Err1.is_contiguous() and s1.is_contiguous()):
        raise ValueError("gptq_block.run_block: W1, Err1 and s1 must be contiguous")
    fmt = scheme.fmt
    asym = z1 is not None
    if asym:
        z1 = z1.to(torch.int32).contiguous()
    lo, hi = (float(fmt.qmin), float(fmt.qmax)) if asym else (-float(fmt.qmax), float(fmt.qmax))
    bb = max(16, 1 << (b - 1).bit_length())
    rows = 16 if bb <= 128 else 8
    grid = (-(-n // rows),)
    gptq_block_kernel[grid](W1, Err1, s1, z1 if asym else s1, Hinv1, n, b, Hinv1.stride(0), Hinv1.stride(1), lo, hi,
                  ASYM=asym, ROWS=rows, BB=bb, num_warps=4, enable_fp_fusion=False)
