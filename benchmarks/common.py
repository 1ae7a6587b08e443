"""Benchmark plumbing shared by the suites: rows, timing, peak memory, peaks and tolerances.

Method (ARCHITECTURE.md, "Benchmark method"):

Timing. Every candidate of a case is warmed up, calibrated to ~TARGET_S (50 ms) per
measurement, then measured in interleaved rounds (A B C, B C A, ...) so that drift of the
machine hits every candidate alike; the reported time is the median over rounds and every
round's figure is kept (Row.rounds_ms, their spread is the run's noise). CPU measurements are
torch.utils.benchmark.Timer with all threads; CUDA ones are CUDA events around the calls.

Allocator (CPU, glibc). Timing runs with a fixed 32 MB mmap threshold and no heap trimming
(steady_allocator): with glibc's dynamic threshold, whether a process keeps mmapping and page
faulting every fresh output depends on the order of its first frees. Each case's timing starts
from a trimmed heap (malloc_trim), whatever ran before it: otherwise free space left at the
heap's top by earlier cases would serve allocations over the threshold without page faults
(eager decode's 64 MB repeat_interleave: 10 ms after some cases, 30-70 ms after others).

Peak memory is measured per case, right after the case's timing (case_memory), with glibc
switched to memory-tracking mode for the measurement only (tracking_allocator): every
allocation of 64 KiB or more is served by mmap and given back on free, and free heap pages are
returned (malloc_trim), so the resident set tracks live memory; the kernel's high-water mark
(VmHWM, reset through /proc/self/clear_refs) after one call minus the resident set before it is
the call's peak (resolution about 0.5 MiB: the kernel batches its RSS counters per CPU). Then
glibc goes back to the timing mode. mmap-per-allocation makes allocation slower, so it is never
on while timing; what it leaves behind, a trimmed heap, is where the next case's timing starts
anyway, and that case's warm-up (>= 0.2 s) regrows the heap before anything is timed. On CUDA:
torch.cuda.max_memory_allocated, in the same place.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

ROUNDS = int(os.environ.get("FASTFORMER_BENCH_ROUNDS", "7"))
TARGET_S = float(os.environ.get("FASTFORMER_BENCH_TARGET_S", "0.05"))


@dataclass
class Row:
    suite: str
    case: str                 # shape / variant description
    dtype: str
    mode: str                 # fwd | fwd+bwd | inference | train
    times_ms: dict            # candidate -> median ms
    work: dict = field(default_factory=dict)   # {"flops": ..} or {"bytes": ..}
    max_err: Optional[float] = None            # ours vs reference
    peak_mb: dict = field(default_factory=dict)  # candidate -> MiB
    note: str = ""
    rounds_ms: dict = field(default_factory=dict)  # candidate -> ms per call in each round
    tolerance: Optional[float] = None          # the verdict's bound on max_err (None: unchecked)

    def ratio(self, base: str, cand: str = "ours") -> Optional[float]:
        if base in self.times_ms and cand in self.times_ms and self.times_ms[cand] > 0:
            return self.times_ms[base] / self.times_ms[cand]
        return None

    @property
    def passed(self) -> Optional[bool]:
        """max_err within tolerance (a NaN error fails); None when either is unknown."""
        if self.max_err is None or self.tolerance is None:
            return None
        return math.isfinite(self.max_err) and self.max_err <= self.tolerance


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---- timing ---------------------------------------------------------------------------------------
def _sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def _measure(fn: Callable, device: str, threads: int) -> Callable[[int], float]:
    """measure(number) -> seconds per call, averaged over `number` back-to-back calls."""
    if device == "cuda":
        def measure(number):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(number):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e-3 / number
        return measure
    from torch.utils.benchmark import Timer
    timer = Timer("fn()", globals={"fn": fn}, num_threads=threads)
    return lambda number: timer.timeit(number).median


def _single_call(fn: Callable, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def time_rounds(fns: dict, device: str = "cpu", rounds: int = ROUNDS) -> dict:
    """{candidate: [ms per call in each round]}, the candidates measured interleaved."""
    threads = torch.get_num_threads()
    if device == "cpu" and _glibc():
        # Every case starts from a trimmed heap, whatever ran before it (module docstring).
        _glibc().malloc_trim(0)
    measures, numbers, per_call = {}, {}, {}
    for name, fn in fns.items():
        # Warm-up of >= 0.2 s (at least 2 calls; 1 for calls over a second): the allocator
        # must reach steady state (a fresh 16 MB output costs page faults until the heap has
        # grown, measured 2x slower for the first ~10 calls).
        _sync(device)
        start, calls = time.perf_counter(), 0
        while calls < 2 or time.perf_counter() - start < 0.2:
            fn()
            calls += 1
            if time.perf_counter() - start > 1.0:
                break
        _sync(device)
        per_call[name] = (time.perf_counter() - start) / calls
        numbers[name] = max(1, int(TARGET_S / max(per_call[name], 1e-7)))
        measures[name] = _measure(fn, device, threads)
    # A call over TARGET_S / 2 (number == 1) is timed as one call per round, without the 2
    # warm-up calls Timer.timeit makes before each measurement (they would triple the time
    # spent on it, and the call's own working set is far beyond the caches they would warm).
    single = {name for name in fns if numbers[name] == 1}
    if any(per_call[name] > 1.0 for name in fns):
        # Calls over a second (attention fwd+bwd at (1, 16, 4096, 128)): five rounds, not
        # three, so that a median is not one call's luck (with three, that cell's ratio to SDPA
        # spread over 1.14-1.28x across runs of the same kernels).
        rounds = min(rounds, 5)
    samples = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            if name in single:
                samples[name].append(1e3 * _single_call(fns[name], device))
            else:
                samples[name].append(1e3 * measures[name](numbers[name]))
    return samples


def time_candidates(fns: dict, device: str = "cpu", rounds: int = ROUNDS) -> dict:
    """Median milliseconds per call of each candidate, measured interleaved."""
    return {name: statistics.median(v) for name, v in time_rounds(fns, device, rounds).items()}


# ---- allocator (CPU, glibc) -----------------------------------------------------------------------
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_libc = None


def _glibc():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
        except OSError:
            _libc = False
    return _libc


def steady_allocator() -> bool:
    """Timing mode: serve allocations up to 32 MB from glibc's heap and never trim it.

    With glibc's default dynamic mmap threshold, whether a process keeps mmapping (and page
    faulting) every 1.5 MB output depends on the order of its first frees: the same eager
    F.layer_norm(x + r) at (512, 768) measured 0.2 ms in some processes and 2 ms in others.
    A fixed threshold gives every candidate the same steady state; tensors over 32 MB (glibc's
    cap) are still mmapped per call, for every candidate alike.
    """
    libc = _glibc()
    return bool(libc and libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
                and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))


@contextlib.contextmanager
def tracking_allocator():
    """Memory-tracking mode for the block (yields whether it is on), timing mode after it."""
    libc = _glibc()
    on = bool(libc and os.path.exists("/proc/self/clear_refs")
              and libc.mallopt(_M_MMAP_THRESHOLD, 65536) and libc.mallopt(_M_TRIM_THRESHOLD, 65536))
    try:
        yield on
    finally:
        if libc:
            steady_allocator()


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _tracked_peak_mb(fn: Callable) -> float:
    """fn()'s peak extra resident memory (MiB), glibc being in memory-tracking mode."""
    fn()  # warm: lazy initialisation must not count
    _glibc().malloc_trim(0)  # free heap pages go back to the OS, so reusing them shows in the RSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_bytes("VmRSS")
    out = fn()
    peak = _status_bytes("VmHWM") - base
    del out
    return peak / 2**20


def _cuda_peak_mb(fn: Callable) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def case_memory(fns: dict, device: str = "cpu") -> dict:
    """{candidate: peak extra MiB while it runs, its results dropped at the end} of one case,
    measured right after its timing (module docstring); None where it cannot be measured."""
    if device == "cuda":
        return {name: _cuda_peak_mb(fn) for name, fn in fns.items()}
    with tracking_allocator() as on:
        return {name: _tracked_peak_mb(fn) if on else None for name, fn in fns.items()}


def peak_memory_mb(fn: Callable, device: str = "cpu") -> Optional[float]:
    """Peak extra memory (MiB) while fn() runs, its results dropped at the end."""
    return case_memory({"fn": fn}, device)["fn"]


# ---- peaks for the '% peak' column ----------------------------------------------------------------
def measure_peaks(device: str, dtypes: list) -> dict:
    """The device's matmul GFLOP/s in each dtype of the run (torch.mm in that dtype: on CPU
    torch's bf16 GEMMs use AVX512-BF16 / AMX where the CPU has them) and its copy GB/s."""
    gflops = {}
    n_max = 2048 if device == "cpu" else 8192
    for dtype in dtypes:
        # Grow the product until one call takes 20 ms (a dtype without a fast path, bf16 on
        # an AVX2-only CPU, runs at a few GFLOP/s: 2048^3 would take seconds).
        n = 256
        while True:
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            torch.mm(a, b)
            if n >= n_max or _single_call(lambda: torch.mm(a, b), device) > 0.02:
                break
            n *= 2
        ms = time_candidates({"mm": lambda: torch.mm(a, b)}, device, rounds=3)["mm"]
        gflops[dtype_name(dtype)] = 2 * n ** 3 / (ms * 1e-3) / 1e9
    x = torch.randn(32 * 2 ** 20, device=device)
    y = torch.empty_like(x)
    ms = time_candidates({"copy": lambda: y.copy_(x)}, device, rounds=3)["copy"]
    return {"matmul_gflops": gflops, "copy_gbps": 2 * x.numel() * 4 / (ms * 1e-3) / 1e9}


# ---- tolerances for the verdict -------------------------------------------------------------------
FP32_ATOL = FP32_RTOL = 1e-5           # tests/oracle.py: check()'s default for outputs
OUT_FACTOR = 2.0                       # tests/oracle.py: the error-ratio rule's factor for outputs
LOWP_ATOL = {"bfloat16": 1e-4, "float16": 1e-5}


def policy_tolerance(magnitude: float, eager_err: dict) -> dict:
    """{dtype: bound on max |ours - ref|} by the numerical policy (ARCHITECTURE.md), for a
    suite whose reference outputs reach `magnitude` and where eager PyTorch's own max error
    against the same reference is eager_err[dtype] (fp16 / bf16, measured on the suite's
    seeded inputs).

    fp32: atol + rtol * |oracle| holds for every element, so the max error is at most
    atol + rtol * magnitude. fp16 / bf16: the error-ratio rule, OUT_FACTOR * eager's error +
    one rounding of the largest output (eps * magnitude) + the rule's atol.
    """
    fixed = FP32_ATOL + FP32_RTOL * magnitude
    out = {"float32": fixed}
    for dtype, err in eager_err.items():
        eps = torch.finfo(getattr(torch, dtype)).eps
        out[dtype] = OUT_FACTOR * err + eps * magnitude + max(LOWP_ATOL[dtype], FP32_ATOL)
    return {k: float(f"{v:.2g}") for k, v in out.items()}


def tolerance(suite_module, row: Row) -> Optional[float]:
    """The bound the verdict holds row.max_err to: the suite's tolerance(row) if it has one,
    else its TOLERANCE[dtype]; None where there is none (the row is reported, not judged)."""
    fn = getattr(suite_module, "tolerance", None)
    if fn is not None:
        return fn(row)
    return getattr(suite_module, "TOLERANCE", {}).get(row.dtype)


def max_abs_err(ours, ref) -> float:
    if isinstance(ours, (tuple, list)):
        return max(max_abs_err(a, b) for a, b in zip(ours, ref))
    if ours is None or ours.numel() == 0:
        return 0.0
    return float((ours.double() - ref.double()).abs().max())


# ---- the machine ----------------------------------------------------------------------------------
def machine_info(device: str) -> dict:
    """CPU model, threads and versions (and the GPU on CUDA), for the JSON, tables and plot."""
    from fastformer import __version__ as ff_version
    info = {"device": device, "torch": torch.__version__, "fastformer": ff_version,
            "python": platform.python_version(), "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, cwd=os.path.dirname(__file__)).stdout.strip() or None
    except OSError:
        info["commit"] = None
    return info
