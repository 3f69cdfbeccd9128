"""Why does the fused quantizer's "tile" kernel give per-token scales that differ from
lowbit.quantize on its own output (seen on sm_90)? Runs every tile config (incl. the refused
(1, 1)) on fresh data and prints, for each mismatching row, the bits of the kernel's scale,
of RN(max|y| / qmax) and of max|y|, with the row's y statistics. GPU only; a diagnosis aid."""
import itertools
import sys

import torch

from lowbit.ops import fused
from lowbit.quantize import quantize
from lowbit.scheme import QuantScheme, get_preset

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SCHEMES = {"int8_token": get_preset("int8_token"), "fp8_token": QuantScheme("fp8_e4m3fn", "token", dynamic=True)}


def bits(t):
    return [hex(v & 0xFFFFFFFF) for v in t.float().contiguous().view(torch.int32).tolist()]


def launch_raw(pre, x2, K, scheme, tile, w=None, res=None):
    """The tile kernel launched directly (the launcher refuses tile=(1, 1)): codes, scale, y."""
    import triton

    from lowbit.ops.triton import fused_quant as fq
    rows, dev = x2.shape[0], x2.device
    block = max(16, triton.next_power_of_2(K))
    R, warps = tile
    fmt = scheme.fmt
    dummy = torch.empty(1, device=dev, dtype=torch.float32)
    codes = torch.empty(rows, K, device=dev, dtype=torch.int8 if fmt.kind == "int" else torch.uint8)
    scale = torch.empty(rows, 1, device=dev, dtype=torch.float32)
    y = torch.empty(rows, K, device=dev, dtype=torch.float32)
    r_out = torch.empty_like(res) if res is not None else dummy
    fq._token_tile_kernel[(triton.cdiv(rows, R),)](
        x2, x2.stride(0), w if w is not None else dummy, res if res is not None else dummy,
        res.stride(0) if res is not None else 0, r_out, r_out.stride(0) if res is not None else 0,
        y, codes, scale, rows, K, 1e-6, PRE=pre, HAS_RES=res is not None, STORE_Y=True, FMT=0 if fmt.kind == "int" else 1,
        QMAX=float(fmt.qmax if fmt.kind == "int" else fmt.max), HW_FP8=x2.is_cuda, FAST_DIV=x2.is_cuda,
        ROWS=R, BLOCK=block, EVEN=block == K and rows % R == 0, num_warps=warps)
    return codes, scale, y


def main():
    bad_total = 0
    g = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    for (name, scheme), tile, (M, K), pre in itertools.product(
            SCHEMES.items(), [(1, 1), (1, 2), (2, 1), (1, 4)], [(5, 200), (3, 4095), (17, 512)], (0, 1, 2, 3)):
        # pre 0: quantize_rows; 1: RMSNorm; 2: RMSNorm + float32 residual; 3: + bf16 residual
        x = torch.randn(M, K, generator=g) * 3.0
        x[:, :7] *= 20
        x[0, 3:9] = -0.0
        x = x.to(torch.bfloat16).to(DEV)
        w = (1 + 0.2 * torch.randn(K, generator=g)).to(torch.bfloat16).to(DEV)
        res = None
        if pre >= 2:
            res = (torch.randn(M, K, generator=g) * 3.0).to(torch.float32 if pre == 2 else torch.bfloat16).to(DEV)
            if M > 1:
                res[1] = -x[1].to(res.dtype)  # an exactly zero residual sum
        try:
            if tile == (1, 1):
                codes, scale, y = launch_raw(min(pre, 1), x, K, scheme, tile, w if pre else None, res)
                qt = type("Q", (), dict(codes=codes, scale=scale))()
                if not pre:
                    y = x.float()
            elif pre:
                qt, _, y = fused.rmsnorm_quant(x, w, 1e-6, scheme, residual=res, backend="triton",
                                               return_normalized=True, kernel="tile", tile=tile)
            else:
                qt, y = fused.quantize_rows(x, scheme, backend="triton", kernel="tile", tile=tile), x.float()
        except ValueError as exc:
            print(f"{name} tile={tile} M={M} K={K} pre={pre}: refused ({str(exc)[:60]})")
            continue
        ref = quantize(y.cpu(), scheme)
        s_k, s_r = qt.scale.cpu().reshape(-1), ref.scale.reshape(-1)
        bad = (s_k != s_r).nonzero().reshape(-1)
        cbad = (qt.codes.cpu() != ref.codes).any(-1).nonzero().reshape(-1)
        print(f"{name} tile={tile} M={M} K={K} pre={pre}: {bad.numel()} scales differ, {cbad.numel()} rows of codes differ")
        for r in bad[:4].tolist():
            yr = y[r].cpu()
            am = yr.abs().max()
            print(f"   row {r}: kernel {bits(s_k[r:r+1])} ref {bits(s_r[r:r+1])} max|y| {bits(am.reshape(1))} "
                  f"argmax {int(yr.abs().argmax())} nan {bool(yr.isnan().any())} zeros {int((yr == 0).sum())}")
            # what amax would give the kernel's scale: is it the max of another row, or max * 1 ulp?
            q = 127.0 if name == "int8_token" else 448.0
            print(f"      kernel scale * qmax = {float(s_k[r]) * q!r}, max|y| = {float(am)!r}, "
                  f"row maxes {[float(v) for v in y.abs().amax(-1).cpu()[:6]]}")
        bad_total += bad.numel() + cbad.numel()
    print("TOTAL mismatches", bad_total)


if __name__ == "__main__":
    main()
