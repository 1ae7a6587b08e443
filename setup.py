"""Build script for fastformer.

The compiled extension ``fastformer._C`` holds the CPU kernels (always) and the CUDA kernels
(only where torch has CUDA and a matching nvcc exists). Build against the torch you will run
with, without build isolation:

    pip install torch==2.13.0          # or any torch >= 2.4 you already have
    pip install --no-build-isolation .

CPU kernels are compiled once per instruction-set level (DEFAULT, AVX2, AVX512 on x86-64) with
that level's flags, and ``_C`` picks the best one the running CPU supports at import time
(override with ``FASTFORMER_CPU_ARCH=default|avx2|avx512``). The per-level objects are built here
in parallel with a small dependency-tracking compile step, because setuptools cannot give one
source file different flags from another in the same extension.

Environment knobs (all optional):
  FASTFORMER_BUILD_CUDA=0/1   force the CUDA kernels off/on (default: on iff torch.version.cuda
                              and nvcc's major version match)
  FASTFORMER_SANITIZE=1       build with -fsanitize=address,undefined (see .ci/sanitize.sh)
  FASTFORMER_CPU_LEVELS=...   compile only these CPU levels (comma list, DEFAULT always)
  FASTFORMER_SKIP_EXT=1       install the pure-Python package only (reference/Triton backends)
  MAX_JOBS=N                  parallel compile jobs (default: CPU count)
"""
from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
VERSION = "0.1.0"


def _env_flag(name: str):
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    return value.lower() not in ("0", "false", "no", "off")


# CPU kernel files, each compiled once per capability level. Keep this list explicit: a file
# added to csrc/cpu/ must also be declared in csrc/cpu/cpu_kernels.h.
CPU_KERNEL_SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cpu").glob("*.cpp"))
CUDA_SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cuda").glob("*.cu"))

# Flags per capability level. The names match ATen's CPU_CAPABILITY convention so that
# at::vec::Vectorized picks its AVX2/AVX512 implementation (without these defines it silently
# falls back to scalar code).
X86_CAPABILITIES = {
    "DEFAULT": [],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mlzcnt", "-mpopcnt"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-mbmi", "-mbmi2", "-mlzcnt", "-mpopcnt"],
}


def _capabilities():
    """Capability levels to compile; FASTFORMER_CPU_LEVELS=DEFAULT,AVX2 builds a subset (the
    sanitizer job uses it to halve its build time). DEFAULT is always built."""
    levels = X86_CAPABILITIES if platform.machine().lower() in ("x86_64", "amd64") else {"DEFAULT": []}
    wanted = os.environ.get("FASTFORMER_CPU_LEVELS")
    if wanted:
        names = {n.strip().upper() for n in wanted.split(",")} | {"DEFAULT"}
        levels = {k: v for k, v in levels.items() if k in names}
    return levels


def _nvcc_version():
    from torch.utils.cpp_extension import CUDA_HOME
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else "nvcc"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _want_cuda(torch) -> bool:
    forced = _env_flag("FASTFORMER_BUILD_CUDA")
    if forced is False:
        return False
    torch_cuda = torch.version.cuda
    nvcc = _nvcc_version()
    match = bool(torch_cuda and nvcc and int(torch_cuda.split(".")[0]) == nvcc[0])
    if forced and not match:
        raise SystemExit(
            f"FASTFORMER_BUILD_CUDA=1 but torch.version.cuda={torch_cuda!r} and nvcc={nvcc!r} "
            "do not match: install a CUDA build of torch whose major version matches nvcc."
        )
    return match


def _ext_modules_and_cmdclass():
    if _env_flag("FASTFORMER_SKIP_EXT"):
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension as ce
    except ImportError:
        raise SystemExit(
            "fastformer's C++ extension is built against the installed torch. Install torch first "
            "(e.g. `pip install torch==2.13.0`), then `pip install --no-build-isolation .` "
            "(or set FASTFORMER_SKIP_EXT=1 for the pure-Python package)."
        )

    sanitize = bool(_env_flag("FASTFORMER_SANITIZE"))
    with_cuda = _want_cuda(torch)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -g1 (line tables): sanitizer reports still name file:line, and the sanitized build of two
    # levels took 252 s against 340 with -g (2-core Zen 3).
    opt = ["-O1", "-g1", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
           "-fno-sanitize-recover=undefined"] if sanitize else ["-O3"]
    common_cflags = opt + [
        "-std=c++20", "-fPIC", "-fopenmp", "-fvisibility=hidden", "-Wall", "-Wno-unused-function",
        "-Wno-unknown-pragmas",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DAT_PARALLEL_OPENMP=1",
    ]
    link_args = ["-fopenmp"] + (["-fsanitize=address,undefined"] if sanitize else [])
    include_dirs = [str(ROOT / "csrc")] + ce.include_paths()
    caps = _capabilities()

    class BuildExt(ce.BuildExtension):
        """Compile the per-capability CPU kernel objects, then let BuildExtension do the rest."""

        def build_extensions(self):
            # Python's own CFLAGS carry -g, which doubles the bindings' compile time for nothing.
            self.compiler.compiler_so = [f for f in self.compiler.compiler_so if f != "-g"]
            super().build_extensions()

        def build_extension(self, ext):
            obj_dir = Path(self.build_temp).resolve() / "fastformer_cpu"
            obj_dir.mkdir(parents=True, exist_ok=True)
            cxx = os.environ.get("CXX", "c++")
            jobs = []
            for cap, cap_flags in caps.items():
                level_cflags = list(common_cflags)
                if cap == "DEFAULT" and len(caps) > 1 and "-O3" in level_cflags:
                    # The pre-AVX2 fallback only runs on CPUs older than 2013: -O2 compiles it
                    # ~25% faster and it is not where speed is measured.
                    level_cflags[level_cflags.index("-O3")] = "-O2"
                for src in CPU_KERNEL_SOURCES:
                    obj = obj_dir / f"{Path(src).stem}.{cap}.o"
                    cmd = [cxx, "-c", str(ROOT / src), "-o", str(obj), "-MMD", "-MF", f"{obj}.d"]
                    cmd += level_cflags + cap_flags + [
                        f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}",
                    ] + [f"-I{d}" for d in include_dirs]
                    jobs.append((obj, cmd))
            # Longest compiles first (source size is a fair proxy), so the last job to finish
            # is a short one and both cores stay busy to the end.
            jobs.sort(key=lambda j: -(ROOT / j[1][2]).stat().st_size)
            njobs = int(os.environ.get("MAX_JOBS", os.cpu_count() or 1))
            pool = ThreadPoolExecutor(max_workers=njobs)
            futures = [(obj, pool.submit(_compile_if_stale, (obj, cmd))) for obj, cmd in jobs]
            # DEFAULT objects first: the linker keeps the first copy of an inline function that
            # several objects define, so shared helpers are the baseline-ISA versions.
            order = {cap: i for i, cap in enumerate(caps)}
            ext.extra_objects = [str(o) for o, _ in sorted(
                jobs, key=lambda j: order[j[0].suffixes[-2][1:]])] + list(ext.extra_objects)

            # The bindings (and CUDA sources) compile through ninja meanwhile; the kernel
            # objects are only needed at link time, so wait for them there.
            link = self.compiler.link_shared_object

            def link_after_kernels(*args, **kwargs):
                for obj, future in futures:
                    result = future.result()
                    if result is not None:
                        raise SystemExit(f"compiling {obj.name} failed:\n{result}")
                return link(*args, **kwargs)

            self.compiler.link_shared_object = link_after_kernels
            try:
                super().build_extension(ext)
            finally:
                self.compiler.link_shared_object = link
                pool.shutdown(wait=True, cancel_futures=True)

    cxx_flags = list(common_cflags)
    for cap in caps:
        cxx_flags.append(f"-DFF_HAVE_CAP_{cap}=1")
    sources = ["csrc/bindings.cpp"]
    kwargs = dict(include_dirs=include_dirs, extra_link_args=link_args)
    if with_cuda:
        cxx_flags.append("-DFASTFORMER_WITH_CUDA=1")
        nvcc_flags = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo", f"-I{ROOT / 'csrc'}",
                      "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
                      "-gencode=arch=compute_90,code=compute_90"]
        ext = ce.CUDAExtension("fastformer._C", sources + CUDA_SOURCES,
                               extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags}, **kwargs)
    else:
        ext = ce.CppExtension("fastformer._C", sources, extra_compile_args={"cxx": cxx_flags},
                              **kwargs)
    return [ext], {"build_ext": BuildExt.with_options(use_ninja=True)}


def _compile_if_stale(job):
    obj, cmd = job
    dep = Path(f"{obj}.d")
    if obj.exists() and dep.exists() and Path(f"{obj}.cmd").exists():
        if Path(f"{obj}.cmd").read_text() == shlex.join(cmd):
            deps = re.split(r"(?<!\\)\s+", dep.read_text().replace("\\\n", " "))
            deps = [d for d in deps[1:] if d]
            if all(os.path.exists(d) and os.path.getmtime(d) <= obj.stat().st_mtime for d in deps):
                return None
    print(f"[fastformer] compiling {obj.name}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return proc.stderr[-8000:]
    Path(f"{obj}.cmd").write_text(shlex.join(cmd))
    return None


ext_modules, cmdclass = _ext_modules_and_cmdclass()

setup(
    name="fastformer",
    version=VERSION,
    description="Fused Transformer kernels (attention, add+norm, FFN) for CPU, CUDA and Triton",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=["fastformer", "fastformer.ops", "fastformer.modules", "fastformer.integrations",
              "fastformer.reference",
              "fastformer.triton_kernels", "fastformer.benchmarks"],
    package_dir={"fastformer.triton_kernels": "triton_kernels",
                 "fastformer.benchmarks": "benchmarks"},
    package_data={"fastformer.benchmarks": ["*.sh"]},
    install_requires=["torch>=2.4", "numpy", "tqdm"],  # tqdm: fastformer-bench's progress
    extras_require={
        "triton": ["triton>=3.0"],
        "bench": ["matplotlib", "tqdm"],  # fastformer-bench --plot
        "plot": ["matplotlib"],           # the former name of "bench"
        "test": ["pytest", "hypothesis", "numpy"],
    },
    entry_points={"console_scripts": ["fastformer-bench=fastformer.bench:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
