"""Builds lowbit's native libraries ahead of time, without a GPU, with the CUDA toolchain from PyPI.

    python -m lowbit.ops.native.build            # build (or find cached) liblowbit_native.so, print its path
    python -m lowbit.ops.native.build --prefill  # the same for liblowbit_prefill.so (CUTLASS GEMMs, ~2 min)
    python -m lowbit.ops.native.build --check    # compile only (nvcc -c for sm_90a) the decode library, and
                                                 # the prefill library where CUTLASS's headers are found

Two libraries, each cached by the hash of its own sources and flags under $LOWBIT_NATIVE_CACHE (default
~/.cache/lowbit/native)/<hash>/, so a source change rebuilds only its library and a GPU machine can carry
the built files (LOWBIT_NATIVE_LIB / LOWBIT_PREFILL_LIB name them): liblowbit_native.so (the decode
kernels, csrc/decode_kernels.cu; under a minute) and liblowbit_prefill.so (csrc/prefill_kernels.cu, the
CUTLASS prefill GEMMs; kept apart because its CUTLASS instantiations compile for about two minutes). Both
link the CUDA runtime statically and have a C ABI.
The toolchain is found, in order, under $LOWBIT_CUDA_HOME, in the `nvidia/cu13` folder of any sys.path
entry (`pip install lowbit[hopper]`: nvidia-cuda-nvcc, -nvvm, -cccl, -crt, -runtime), in the virtual
environment's cuda-toolchain/ folder (scripts/setup.sh), under $CUDA_HOME,
and next to an `nvcc` on PATH. CUTLASS's headers (the prefill library only) are found under
$LOWBIT_CUTLASS_DIR (a CUTLASS checkout: include/ and tools/util/include/), in the `cutlass_library`
package of the pip wheel nvidia-cutlass (`pip install lowbit[hopper]`) on sys.path, or in the virtual
environment's cuda-toolchain/ folder. The CPU twin (csrc/host_twin.cpp) builds with the host C++ compiler.
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
PREFILL_PREFIX, PREFILL_SOURCE, PREFILL_LIB = "prefill_", "prefill_kernels.cu", "liblowbit_prefill.so"
# CUTLASS wants relaxed constexpr for its host/device helpers. NDEBUG drops its device-side asserts: their calls
# make ptxas serialize the wgmma pipeline (warning C7510) in the mainloop.
# A register spill in a mainloop is an error, so that a configuration that spills fails the build (and CI).
PREFILL_FLAGS = ("--expt-relaxed-constexpr", "-DNDEBUG", "-Xptxas=-warn-spills,-warn-lmem-usage,--warning-as-error")
CUTLASS_HINT = "pip install 'lowbit[hopper]' brings CUTLASS's headers (nvidia-cutlass) from PyPI"


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


def _is_prefill(p: Path) -> bool:
    return p.name.startswith(PREFILL_PREFIX)


def source_hash(flags: tuple[str, ...], prefill: bool = False) -> str:
    """The hash of one library's sources (csrc/prefill_* for the prefill library, the rest for the decode one)."""
    h = hashlib.sha256(" ".join(flags).encode())
    for p in sorted(CSRC.iterdir()):
        if p.suffix in (".h", ".cu", ".cpp") and _is_prefill(p) == prefill:
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


def _cutlass_candidates() -> list[tuple[Path, Path]]:
    """(include dir, tools/util/include dir) pairs to try, in the module docstring's order."""
    roots = [Path(os.environ["LOWBIT_CUTLASS_DIR"])] if os.environ.get("LOWBIT_CUTLASS_DIR") else []
    roots += [Path(p) / "cutlass_library" / "source" for p in sys.path if p]
    roots.append(Path(sys.prefix) / "cuda-toolchain" / "cutlass_library" / "source")   # scripts/setup.sh
    return [(r / "include", r / "tools" / "util" / "include") for r in roots]


def find_cutlass() -> tuple[Path, Path] | str:
    """CUTLASS's include directories (the library's and its util headers'), or why they are not found."""
    for inc, util in _cutlass_candidates():
        if (inc / "cutlass" / "version.h").is_file() and (util / "cutlass" / "util" / "packed_stride.hpp").is_file():
            return inc, util
    return f"CUTLASS's headers are not found (LOWBIT_CUTLASS_DIR, cutlass_library on sys.path; {CUTLASS_HINT})"


def _prefill_flags(cutlass: tuple[Path, Path], extra: tuple[str, ...] = ()) -> tuple[str, tuple[str, ...]]:
    """(the cache hash, the nvcc flags) of the prefill library: the hash covers CUTLASS's version, not its path."""
    flags = NVCC_FLAGS + PREFILL_FLAGS + tuple(extra)
    version = (cutlass[0] / "cutlass" / "version.h").read_text()
    return source_hash(flags + (version,), prefill=True), flags + (f"-I{cutlass[0]}", f"-I{cutlass[1]}")


def _cutlass_or_raise() -> tuple[Path, Path]:
    found = find_cutlass()
    if isinstance(found, str):
        raise RuntimeError(found)
    return found


def cached_prefill_library() -> Path | None:
    """The built prefill library of the current sources if it is in the cache, else None."""
    found = find_cutlass()
    if isinstance(found, str):
        return None
    p = cache_root() / _prefill_flags(found)[0] / PREFILL_LIB
    return p if p.exists() else None


def build_prefill_library(progress=print, link: bool = True) -> Path:
    """liblowbit_prefill.so of the current sources (built into the cache if it is not there; about two minutes),
    or with link=False only its object file (the compile check)."""
    tc, cutlass = _toolchain_or_raise(), _cutlass_or_raise()
    key, flags = _prefill_flags(cutlass, () if link else ("-c",))
    lib = tc.root / "lib"
    mode = ["-shared"] if link else []
    tail = [f"-L{lib}", "-lcudart_static", "-lrt", "-ldl", "-lpthread"] if link else []
    what = (f"{'compiling' if link else 'compile check of'} {PREFILL_SOURCE} for {ARCH} with {tc.nvcc} "
            "(CUTLASS: about two minutes)")
    return _build_into(cache_root() / key / (PREFILL_LIB if link else "prefill_kernels.o"),
                       lambda out: [str(tc.nvcc), *flags, *mode, str(CSRC / PREFILL_SOURCE), "-o", str(out), *tail],
                       what, progress)


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
    ap.add_argument("--check", action="store_true",
                    help="compile only (nvcc -c): the decode kernels, and the prefill GEMMs where CUTLASS is found")
    ap.add_argument("--prefill", action="store_true", help="build the prefill library (CUTLASS GEMMs) instead")
    ap.add_argument("--twin", action="store_true", help="also build the CPU twin")
    args = ap.parse_args(argv)
    progress = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    try:
        if args.check:
            paths = [compile_check(progress)]
            if args.prefill or not isinstance(find_cutlass(), str):
                paths.append(build_prefill_library(progress, link=False))
            else:
                progress(f"lowbit native: prefill compile check skipped: {find_cutlass()}")
        else:
            paths = [build_prefill_library(progress) if args.prefill else build_library(progress)]
        if args.twin:
            print(build_twin(progress))
    except RuntimeError as exc:
        print(f"lowbit native: {exc}", file=sys.stderr)
        return 1
    print("\n".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
