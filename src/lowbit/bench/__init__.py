"""GPU benchmarks: each module measures lowbit kernels next to their baselines in one process."""
# Modules that contribute rows to `lowbit bench`; each exposes run(only, quick) -> list[dict].
BENCH_MODULES = ["lowbit.bench.gemm", "lowbit.bench.memory", "lowbit.bench.model", "lowbit.bench.attention"]
