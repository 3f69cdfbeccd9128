"""Builds lowbit's native library ahead of time, without a GPU, with the CUDA toolchain from PyPI.

    python -m lowbit.ops.native.build            # build (or find cached) liblowbit_native.so, print its path
    python -m lowbit.ops.native.build --check    # compile only (nvcc -c for sm_90a): what CI runs

The library (csrc/decode_kernels.cu, the CUDA runtime linked statically, a C ABI) is cached by the hash
of its sources and flags under $LOWBIT_NATIVE_CACHE (default ~/.cache/lowbit/native)/<hash>/, so a
source change rebuilds it and a GPU machine can carry the built file (LOWBIT_NATIVE_LIB names it).
The toolchain is found, in order, under $LOWBIT_CUDA_HOME, in the `nvidia/cu13` folder of any sys.path
entry (`pip install lowbit[hopper]`: nvidia-cuda-nvcc, -nvvm, -cccl, -crt, -runtime), in the virtual
environment's cuda-toolchain/ folder (scripts/setup.sh), under $CUDA_HOME,
and next to an `nvcc` on PATH. The CPU twin (csrc/host_twin.cpp) builds with the host C++ compiler.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
ARCH = "sm_90a"
NVCC_FLAGS = ("-O3", "-std=c++17", "-lineinfo", f"-arch={ARCH}", "-Xcompiler", "-fPIC")
CXX_FLAGS = ("-O2", "-std=c++17", "-ffp-contract=off", "-fPIC", "-shared")
LIB_NAME, TWIN_NAME = "liblowbit_native.so", "liblowbit_twin.so"
HOPPER_HINT = "pip install 'lowbit[hopper]' brings it from PyPI"


@dataclass(frozen=True)
class Toolchain:
    root: Path          # holds bin/nvcc, nvvm/bin/cicc, include/, lib/libcudart_static.a

    @property
    def nvcc(self) -> Path:
        return self.root / "bin" / "nvcc"


# what a usable CUDA root holds: (path under it, the pip package that brings it)
_NEEDS = (("bin/nvcc", "nvidia-cuda-nvcc"), ("bin/ptxas", "nvidia-cuda-nvcc"), ("nvvm/bin/cicc", "nvidia-nvvm"),
          ("include/cuda_runtime.h", "nvidia-cuda-runtime"), ("include/crt/host_config.h", "nvidia-cuda-crt"),
          ("include/cccl", "nvidia-cuda-cccl"), ("lib/libcudart_static.a", "nvidia-cuda-runtime"))


def _missing(root: Path) -> list[str]:
    return [f"{rel} ({pkg})" for rel, pkg in _NEEDS
            if not (root / rel).exists() and not (rel.startswith("lib/") and (root / rel.replace("lib/", "lib64/")).exists())]


def _candidates() -> list[Path]:
    roots = [Path(os.environ[v]) for v in ("LOWBIT_CUDA_HOME",) if os.environ.get(v)]
    roots += [Path(p) / "nvidia" / "cu13" for p in sys.path if p]
    roots.append(Path(sys.prefix) / "cuda-toolchain" / "nvidia" / "cu13")   # scripts/setup.sh puts it there
    roots += [Path(os.environ[v]) for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(Path(nvcc).resolve().parent.parent)
    return roots


def find_toolchain() -> Toolchain | str:
    """The first complete CUDA toolchain (see the module docstring), or why there is none."""
    partial = []
    for root in _candidates():
        if not (root / "bin" / "nvcc").exists():
            continue
        missing = _missing(root)
        if not missing:
            return Toolchain(root)
        partial.append(f"{root} lacks {', '.join(missing)}")
    if partial:
        return "incomplete CUDA toolchain: " + "; ".join(partial) + f" ({HOPPER_HINT})"
    return f"no CUDA compiler found (no nvcc under LOWBIT_CUDA_HOME, nvidia/cu13 on sys.path, CUDA_HOME or PATH; {HOPPER_HINT})"


def cache_root() -> Path:
    return Path(os.environ.get("LOWBIT_NATIVE_CACHE") or Path.home() / ".cache" / "lowbit" / "native")


def source_hash(flags: tuple[str, ...]) -> str:
    h = hashlib.sha256(" ".join(flags).encode())
    for p in sorted(CSRC.iterdir()):
        if p.suffix in (".h", ".cu", ".cpp"):
            h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def cached_library() -> Path | None:
    """The built library of the current sources if it is in the cache, else None."""
    p = cache_root() / source_hash(NVCC_FLAGS) / LIB_NAME
    return p if p.exists() else None


def _run(cmd: list[str], what: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{what} failed (exit {r.returncode}):\n{' '.join(cmd)}\n{r.stdout}{r.stderr}")


def _build_into(target: Path, cmd_for, what: str, progress) -> Path:
    """Runs cmd_for(tmp_output) and moves the result to `target` atomically (concurrent builders are safe)."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    progress(f"lowbit native: {what} -> {target}")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        _run(cmd_for(out), what)
        os.replace(out, target)
    progress(f"lowbit native: {what} done in {time.perf_counter() - t0:.1f} s")
    return target


def _toolchain_or_raise() -> Toolchain:
    tc = find_toolchain()
    if isinstance(tc, str):
        raise RuntimeError(tc)
    return tc


def build_library(progress=print) -> Path:
    """liblowbit_native.so of the current sources (built into the cache if it is not there)."""
    tc = _toolchain_or_raise()
    target = cache_root() / source_hash(NVCC_FLAGS) / LIB_NAME
    lib = tc.root / "lib"
    return _build_into(target, lambda out: [str(tc.nvcc), *NVCC_FLAGS, "-shared", str(CSRC / "decode_kernels.cu"),
                                            "-o", str(out), f"-L{lib}", "-lcudart_static", "-lrt", "-ldl", "-lpthread"],
                       f"compiling decode_kernels.cu for {ARCH} with {tc.nvcc} (under a minute)", progress)


def compile_check(progress=print) -> Path:
    """Compiles the kernels for sm_90a into an object file (no link, no GPU): CI's compile step."""
    tc = _toolchain_or_raise()
    target = cache_root() / source_hash(NVCC_FLAGS + ("-c",)) / "decode_kernels.o"
    return _build_into(target, lambda out: [str(tc.nvcc), *NVCC_FLAGS, "-c", str(CSRC / "decode_kernels.cu"), "-o", str(out)],
                       f"compile check of decode_kernels.cu for {ARCH}", progress)


def host_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build_twin(progress=print) -> Path:
    """liblowbit_twin.so: the kernels' CPU twin, built with the host C++ compiler."""
    cxx = host_compiler()
    if cxx is None:
        raise RuntimeError("no host C++ compiler (g++ / c++ on PATH, or CXX) to build the native kernels' CPU twin")
    target = cache_root() / source_hash(CXX_FLAGS + ("twin",)) / TWIN_NAME
    return _build_into(target, lambda out: [cxx, *CXX_FLAGS, str(CSRC / "host_twin.cpp"), "-o", str(out)],
                       "compiling the CPU twin host_twin.cpp", progress)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lowbit.ops.native.build", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compile only (nvcc -c), as CI does")
    ap.add_argument("--twin", action="store_true", help="also build the CPU twin")
    args = ap.parse_args(argv)
    progress = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    try:
        path = compile_check(progress) if args.check else build_library(progress)
        if args.twin:
            print(build_twin(progress))
    except RuntimeError as exc:
        print(f"lowbit native: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
