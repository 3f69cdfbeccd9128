"""What does torch._scaled_mm's fast accumulation (use_fast_accum=True) keep? Writes, for
same-sign fp8 inputs at several K, the codes, the outputs with and without fast accumulation and
the exact float64 product to $OUT/fastaccum_probe.npz (numpy arrays, no pickles), so the
accumulator model in lowbit/verify/accumulate.py can be fitted offline. GPU (sm_89+) only.
On an H200 fast accumulation loses ~8% of a K = 4096 same-sign sum, more than a
14-bits-per-32-wide-step truncation model reproduces. PROBE_M sets the rows (default
16; 1 probes the one-row path, docs/diagnosis.md "The fp8 tensor-core accumulator")."""
import os

import numpy as np
import torch


def main():
    g = torch.Generator().manual_seed(0)
    M, N = int(os.environ.get("PROBE_M", "16")), 32  # PROBE_M=1: cuBLAS's one-row kernel (docs/diagnosis.md)
    arrays = {}
    one = torch.ones((), device="cuda")
    for K in (256, 1024, 4096, 16384):
        for sign in ("same", "mixed"):
            x = torch.rand(M, K, generator=g) + 0.5
            w = torch.rand(N, K, generator=g) + 0.5
            if sign == "mixed":
                x = x * torch.where(torch.rand(M, K, generator=g) < 0.5, -1.0, 1.0)
            a = x.to(torch.float8_e4m3fn)
            b = w.to(torch.float8_e4m3fn)
            exact = a.double() @ b.double().T
            ac, bc = a.cuda(), b.cuda()
            for fast in (False, True):
                out = torch._scaled_mm(ac, bc.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                                       use_fast_accum=fast)
                arrays[f"K{K}_{sign}_{'fast' if fast else 'precise'}"] = out.cpu().double().numpy()
            arrays[f"K{K}_{sign}_exact"] = exact.numpy()
            arrays[f"K{K}_{sign}_a"] = a.view(torch.uint8).numpy()
            arrays[f"K{K}_{sign}_b"] = b.view(torch.uint8).numpy()
            rel = lambda k: float(np.median(arrays[f"K{K}_{sign}_{k}"] / exact.numpy()))  # noqa: E731
            print(f"K={K:6d} {sign:5s}: median out/exact precise {rel('precise'):.6f}, fast {rel('fast'):.6f}")
    np.savez_compressed(os.path.join(os.environ.get("OUT", "."), "fastaccum_probe.npz"), **arrays)


if __name__ == "__main__":
    main()
