"""Benchmark plumbing shared by the suites: timing, peak memory, tables, JSON and plots.

Timing (ARCHITECTURE.md, "Benchmark method"): every candidate of a case is warmed up,
calibrated to ~TARGET_S (50 ms) per measurement, then measured in interleaved rounds (A B C,
B C A, ...) so that drift of the machine hits every candidate alike; the reported time is the
median over rounds. CPU uses torch.utils.benchmark.Timer with all threads; GPU uses
triton.testing.do_bench.

Peak memory on CPU: glibc is told to serve every allocation >= 64 KiB with mmap and to give it
back on free, and free heap pages are returned (malloc_trim) before each measurement, so the
process's resident set tracks live memory; the kernel's high-water mark (VmHWM, reset through
/proc/self/clear_refs) minus the resident set before the call is the call's peak (resolution
about 0.5 MiB: the kernel batches its RSS counters per CPU). This runs after all timing, because mmap-per-allocation makes allocation slower.
On CUDA: torch.cuda.max_memory_allocated.
"""
from __future__ import annotations

import ctypes
import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
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

    def ratio(self, base: str, cand: str = "ours") -> Optional[float]:
        if base in self.times_ms and cand in self.times_ms and self.times_ms[cand] > 0:
            return self.times_ms[base] / self.times_ms[cand]
        return None


def _sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def time_candidates(fns: dict, device: str = "cpu", rounds: int = ROUNDS) -> dict:
    """Median milliseconds per call of each candidate, measured interleaved."""
    if device == "cuda":
        from triton.testing import do_bench
        out = {}
        for _ in range(2):  # two interleaved passes; keep the best median of each
            for name, fn in fns.items():
                t = do_bench(fn, warmup=25, rep=100)
                out[name] = min(out.get(name, float("inf")), t)
        return out
    from torch.utils.benchmark import Timer
    threads = torch.get_num_threads()
    timers, numbers, slow = {}, {}, set()
    for name, fn in fns.items():
        # Warm-up of >= 0.2 s (at least 2 calls; 1 for calls over a second): the allocator
        # must reach steady state (a fresh 16 MB output costs page faults until the heap has
        # grown, measured 2x slower for the first ~10 calls).
        start, calls = time.perf_counter(), 0
        while calls < 2 or time.perf_counter() - start < 0.2:
            fn()
            calls += 1
            if time.perf_counter() - start > 1.0:
                break
        per_call = (time.perf_counter() - start) / calls
        if per_call > 1.0:
            slow.add(name)  # single timed calls (Timer.timeit adds 2 warm-up calls per round)
        numbers[name] = max(1, int(TARGET_S / max(per_call, 1e-7)))
        timers[name] = Timer("fn()", globals={"fn": fn}, num_threads=threads)
    if slow:
        # Calls over a second (attention fwd+bwd at (1, 16, 4096, 128)): five single calls each,
        # not three, so that a median is not one call's luck (with three, that cell's ratio to
        # SDPA spread over 1.14-1.28x across runs of the same kernels).
        rounds = min(rounds, 5)
    samples = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            if name in slow:
                start = time.perf_counter()
                fns[name]()
                samples[name].append(time.perf_counter() - start)
            else:
                samples[name].append(timers[name].timeit(numbers[name]).median)
    return {name: 1e3 * statistics.median(v) for name, v in samples.items()}


# ---- allocator ----------------------------------------------------------------------------------
def steady_allocator() -> bool:
    """Serve allocations up to 32 MB from glibc's heap and never trim it, for timing.

    With glibc's default dynamic mmap threshold, whether a process keeps mmapping (and page
    faulting) every 1.5 MB output depends on the order of its first frees: the same eager
    F.layer_norm(x + r) at (512, 768) measured 0.2 ms in some processes and 2 ms in others.
    A fixed threshold gives every candidate the same steady state; tensors over 32 MB (glibc's
    cap) are still mmapped per call, for every candidate alike.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except OSError:
        return False


# ---- peak memory --------------------------------------------------------------------------------
_mallopt_done = False
_malloc_trim = None


def _track_allocations():
    global _mallopt_done
    if _mallopt_done:
        return True
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        ok = libc.mallopt(M_MMAP_THRESHOLD, 65536) and libc.mallopt(M_TRIM_THRESHOLD, 65536)
        _mallopt_done = bool(ok) and os.path.exists("/proc/self/clear_refs")
        global _malloc_trim
        _malloc_trim = libc.malloc_trim
    except OSError:
        _mallopt_done = False
    return _mallopt_done


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_memory_mb(fn: Callable, device: str = "cpu") -> Optional[float]:
    """Peak extra memory (MiB) while fn() runs, its results dropped at the end."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        return peak / 2**20
    if not _track_allocations():
        return None
    fn()  # warm: lazy initialisation must not count
    _malloc_trim(0)  # free heap pages go back to the OS, so reusing them shows in the RSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_bytes("VmRSS")
    out = fn()
    peak = _status_bytes("VmHWM") - base
    del out
    return peak / 2**20


def max_abs_err(ours, ref) -> float:
    if isinstance(ours, (tuple, list)):
        return max(max_abs_err(a, b) for a, b in zip(ours, ref))
    if ours is None or ours.numel() == 0:
        return 0.0
    return float((ours.double() - ref.double()).abs().max())


# ---- reporting ------------------------------------------------------------------------------------
def machine_info(device: str) -> dict:
    info = {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, cwd=os.path.dirname(__file__)).stdout.strip() or None
    except OSError:
        info["commit"] = None
    return info


def format_table(rows: list, baselines: list, unit: str, peak: Optional[float]) -> str:
    """A fixed-width table: case, mode, times, speedups vs each baseline, throughput, error."""
    head = ["case", "dtype", "mode", "ours ms"] + [f"{b} ms" for b in baselines]
    head += [f"x{b}" for b in baselines] + [unit, "% peak" if peak else None, "max err", "peak MiB (ours/" + "/".join(baselines) + ")"]
    head = [h for h in head if h is not None]
    lines = []
    for r in rows:
        cells = [r.case, r.dtype, r.mode, f"{r.times_ms.get('ours', float('nan')):.3f}"]
        cells += [f"{r.times_ms[b]:.3f}" if b in r.times_ms else "-" for b in baselines]
        cells += [f"{r.ratio(b):.2f}" if r.ratio(b) else "-" for b in baselines]
        rate = _rate(r)
        cells.append(f"{rate:.1f}" if rate is not None else "-")
        if peak:
            cells.append(f"{100 * rate / peak:.0f}%" if rate is not None else "-")
        cells.append(f"{r.max_err:.2e}" if r.max_err is not None else "-")
        mem = [r.peak_mb.get(k) for k in ["ours"] + baselines]
        cells.append("/".join("-" if m is None else f"{m:.0f}" for m in mem))
        lines.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    out = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in lines]
    notes = [f"  note [{r.case} {r.dtype} {r.mode}]: {r.note}" for r in rows if r.note]
    return "\n".join(out + notes)


def _rate(r: Row) -> Optional[float]:
    t = r.times_ms.get("ours")
    if not t:
        return None
    if "flops" in r.work:
        return r.work["flops"] / (t * 1e-3) / 1e9
    if "bytes" in r.work:
        return r.work["bytes"] / (t * 1e-3) / 1e9
    return None


def write_json(path: str, rows: list, meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)


def write_plot(path: str, rows: list) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib); skipped")
        return
    suites = sorted({r.suite for r in rows})
    fig, axes = plt.subplots(len(suites), 1, figsize=(10, 3.2 * len(suites)), squeeze=False)
    for ax, suite in zip(axes[:, 0], suites):
        sub = [r for r in rows if r.suite == suite]
        labels = [f"{r.case}\n{r.dtype} {r.mode}" for r in sub]
        baselines = sorted({k for r in sub for k in r.times_ms if k != "ours"})
        width = 0.8 / max(1, len(baselines))
        for i, b in enumerate(baselines):
            ax.bar([j + i * width for j in range(len(sub))], [r.ratio(b) or 0 for r in sub], width,
                   label=f"speedup vs {b}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sub))])
        ax.set_xticklabels(labels, fontsize=6, rotation=60, ha="right")
        ax.set_title(suite)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")
