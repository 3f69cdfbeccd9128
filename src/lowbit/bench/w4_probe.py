"""Where the W4A16 decode kernels lose their bandwidth: the "pairs" kernel's weight loads alone.

The pairs kernel at one row of x reads its int4 weights at 1.4-2.0 TB/s on the H200 (docs/benchmarks-
memory.md) while its K loop issues ~2.3 SASS instructions per weight, which is not what limits it
on paper. This probe runs the kernel's weight-load pattern and nothing else: the same grid
(cdiv(N, BLOCK_N) x split), the same [BLOCK_N, 16]-word tiles per 128-code chunk in the same
physical row order, the same one-step register prefetch, every word folded into an XOR so that no
load is dead. If the probe alone cannot go much faster than the kernel, the access pattern (bytes in
flight per SM, tile shape, split) is the limit; if it can, the kernel's dependency chain is.

    python -m lowbit.bench.w4_probe            # on a GPU: the table (also `bash scripts/gpu.sh w4probe`)

The probe's result (each row's XOR over a program's words) is checked against numpy in the tests,
so the probe reads exactly the words it claims to (Triton's interpreter runs it on the CPU)."""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from lowbit.ops.weight_only import pick_config_pairs, prepare_w4, w4a16_linear
from lowbit.profiling.timing import bench_ms, rotating_count
from lowbit.quantize import quantize
from lowbit.scheme import get_preset


@triton.jit
def _pairs_load_probe(W, OUT, N, K_SPLIT, s_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PREFETCH: tl.constexpr):
    """OUT[pid_k, row] = XOR of the int32 words of `row` in codes [pid_k K_SPLIT, (pid_k + 1) K_SPLIT)
    of W [N, K / 8], read as the pairs kernel reads them: BLOCK_K / 8 consecutive words of BLOCK_N
    rows per step (the kernel's [BLOCK_N, 16] tiles of 128 codes side by side), the next step's
    loaded before this one is folded (PREFETCH) or not."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows < N)[:, None]
    CH: tl.constexpr = BLOCK_K // 128
    ptr = W + rows.to(tl.int64)[:, None] * s_wn + pid_k * (K_SPLIT // 8) + tl.arange(0, 16 * CH)[None, :]
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.int32)
    cur = tl.zeros((BLOCK_N, 16 * CH), dtype=tl.int32)
    if PREFETCH:
        cur = tl.load(ptr, mask=ok, other=0, eviction_policy="evict_first")
    for kk in range(0, K_SPLIT, BLOCK_K):
        if PREFETCH:
            nxt = tl.load(ptr + BLOCK_K // 8, mask=ok & (kk + BLOCK_K < K_SPLIT), other=0,
                          eviction_policy="evict_first")
        else:
            cur = tl.load(ptr, mask=ok, other=0, eviction_policy="evict_first")
        acc ^= tl.xor_sum(tl.reshape(cur, (BLOCK_N, CH, 16)), axis=1)
        if PREFETCH:
            cur = nxt
        ptr += BLOCK_K // 8
    tl.store(OUT + pid_k * N + rows, tl.xor_sum(acc, axis=1), mask=rows < N)


def probe(words: torch.Tensor, block_n: int, block_k: int, split: int, prefetch: bool = True,
          num_warps: int = 4) -> torch.Tensor:
    """int32 [split, N]: each row's XOR over its words in each split of K (see _pairs_load_probe).
    words: int32 [N, K / 8], the pairs layout's packed weight viewed as words."""
    N, KW = words.shape
    K = KW * 8
    if block_k % 128 or K % (block_k * split):
        raise ValueError(f"block_k={block_k} must be a multiple of 128 and block_k * split must divide K={K}")
    out = torch.empty(split, N, dtype=torch.int32, device=words.device)
    _pairs_load_probe[(triton.cdiv(N, block_n), split)](words, out, N, K // split, words.stride(0),
                                                         BLOCK_N=block_n, BLOCK_K=block_k,
                                                         PREFETCH=prefetch, num_warps=num_warps)
    return out


def run(shapes=((8192, 8192), (28672, 8192)), log=print) -> list[dict]:
    """On a GPU: for each weight shape, the pairs kernel at one row (its default config, CUDA graph)
    against the load probe at that config and at a sweep of tiles / splits / prefetch; GB/s of the
    weight words only (the kernel also reads x and the fp32 group scales: ~6% more bytes at g128)."""
    rows = []
    for N, K in shapes:
        nbytes = N * K // 2
        # as many weights as the memory bench rotates through, so that no run reads the previous one's from L2
        sets = [prepare_w4(quantize(torch.randn(N, K, device="cuda") * 0.02, get_preset("int4_g128")), layout="pairs")
                for _ in range(rotating_count(nbytes))]
        words = [(w.packed.view(torch.int32),) for w in sets]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        cfg = pick_config_pairs(1, N, K, 128)
        ms = bench_ms(lambda w: w4a16_linear(x, w), [(w,) for w in sets], cuda_graph=True)
        rows.append(dict(what="pairs kernel, M = 1", N=N, K=K, config=cfg, us=ms * 1e3, GBps=nbytes / ms / 1e6))
        log(f"N={N} K={K} pairs kernel {cfg}: {ms * 1e3:.1f} us {nbytes / ms / 1e6:.0f} GB/s")
        base = (cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["split"], True, cfg["num_warps"])
        # 24 compiled variants (BLOCK_N x BLOCK_K x prefetch x warps; the split is a run-time argument)
        sweep = [base] + [c for c in itertools.product((128, 256), (256, 512, 1024), (2, 4, 8), (True, False), (4, 8))
                          if c != base and K % (c[1] * c[2]) == 0 and c[0] % (16 * c[4]) == 0]
        for bn, bk, split, pre, warps in sweep:
            try:
                ms = bench_ms(lambda wd: probe(wd, bn, bk, split, pre, warps), words, cuda_graph=True)
            except Exception as exc:  # one config that does not compile must not hide the others
                log(f"  probe BN={bn} BK={bk} split={split} prefetch={pre} warps={warps}: {type(exc).__name__}")
                continue
            rows.append(dict(what="load probe", N=N, K=K, BLOCK_N=bn, BLOCK_K=bk, split=split, prefetch=pre,
                             num_warps=warps, us=ms * 1e3, GBps=nbytes / ms / 1e6))
        del sets, words
        torch.cuda.empty_cache()
        probes = sorted((r for r in rows if r["what"] == "load probe" and r["N"] == N), key=lambda r: r["us"])
        same = next((r for r in probes if (r["BLOCK_N"], r["BLOCK_K"], r["split"], r["prefetch"],
                                            r["num_warps"]) == base), None)
        if same:
            log(f"  probe at the kernel's config: {same['us']:.1f} us {same['GBps']:.0f} GB/s")
        for r in probes[:5]:
            log(f"  probe BN={r['BLOCK_N']} BK={r['BLOCK_K']} split={r['split']} prefetch={r['prefetch']} "
                f"warps={r['num_warps']}: {r['us']:.1f} us {r['GBps']:.0f} GB/s")
    return rows


if __name__ == "__main__":
    import json
    import sys

    if not torch.cuda.is_available():
        raise SystemExit("lowbit.bench.w4_probe times GPU loads: it needs a CUDA GPU")
    result = run()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"# wrote {sys.argv[1]}")
