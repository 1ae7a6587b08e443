"""``python -m fastformer.bench`` / ``fastformer-bench``: the benchmark suite with correctness checks.

Runs every suite on the default device (CUDA if present, else CPU) and prints one table per
suite: time of ours and of each PyTorch baseline (measured interleaved in this run), speedups,
achieved GB/s or GFLOP/s (and the share of the machine's measured peak on CPU), the max error
of ours against the reference, and peak memory. See benchmarks/common.py for the method.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time

import torch

from .benchmarks import common

SUITES = ["layernorm", "attention", "decode", "ffn", "layers", "models", "loss"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _available_suites():
    out = []
    for name in SUITES:
        try:
            importlib.import_module(f"fastformer.benchmarks.{name}")
            out.append(name)
        except ImportError:
            pass
    return out


def measure_peak(device: str) -> dict:
    """The machine's matmul GFLOP/s and copy GB/s, measured now (for the '% peak' column)."""
    from torch.utils.benchmark import Timer
    n = 2048 if device == "cpu" else 8192
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    if device == "cuda":
        fns = {"mm": lambda: a @ b}
        mm = 2 * n ** 3 / (common.time_candidates(fns, device)["mm"] * 1e-3) / 1e9
    else:
        t = Timer("a @ b", globals={"a": a, "b": b}, num_threads=torch.get_num_threads())
        mm = 2 * n ** 3 / t.blocked_autorange(min_run_time=0.5).median / 1e9
    x = torch.randn(32 * 2 ** 20, device=device)
    y = torch.empty_like(x)
    ms = common.time_candidates({"copy": lambda: y.copy_(x)}, device, rounds=3)["copy"]
    return {"matmul_gflops": mm, "copy_gbps": 2 * x.numel() * 4 / (ms * 1e-3) / 1e9}


def run(args) -> list:
    device = args.device
    dtypes = [DTYPES[d] for d in args.dtype]
    if device == "cpu" and common.steady_allocator():
        print("# glibc malloc: fixed 32 MB mmap threshold, no trimming (see benchmarks/common.py)")
    peaks = measure_peak(device)
    print(f"# fastformer-bench on {device}: {common.machine_info(device)}")
    print(f"# measured peaks: matmul {peaks['matmul_gflops']:.0f} GFLOP/s (fp32), "
          f"copy {peaks['copy_gbps']:.1f} GB/s")
    all_rows = []
    memory_jobs = []
    for suite in args.op:
        mod = importlib.import_module(f"fastformer.benchmarks.{suite}")
        rows = []
        t0 = time.time()
        for case in mod.cases(device, dtypes, quick=args.quick):
            fns, row, error = mod.build(case)
            row.times_ms = common.time_candidates(fns, device)
            row.max_err = error()
            if not args.no_memory:
                memory_jobs.append((row, fns))
            rows.append(row)
        print(f"# {suite}: {len(rows)} cases in {time.time() - t0:.0f} s")
        all_rows.extend(rows)
    # Memory after all timing: it switches the allocator to mmap-per-allocation on CPU.
    for row, fns in memory_jobs:
        for name, fn in fns.items():
            row.peak_mb[name] = common.peak_memory_mb(fn, device)
    for suite in args.op:
        rows = [r for r in all_rows if r.suite == suite]
        baselines = sorted({k for r in rows for k in r.times_ms if k != "ours"})
        unit = "GFLOP/s" if any("flops" in r.work for r in rows) else "GB/s"
        peak = peaks["matmul_gflops"] if unit == "GFLOP/s" else peaks["copy_gbps"]
        print(f"\n## {suite} ({unit}; % of the measured peak {peak:.0f})")
        print(common.format_table(rows, baselines, unit, peak))
    if args.json:
        common.write_json(args.json, all_rows, {**common.machine_info(device), **peaks})
        print(f"\njson written to {args.json}")
    if args.plot:
        common.write_plot(args.plot, all_rows)
    return all_rows


def main(argv=None) -> int:
    suites = _available_suites()
    p = argparse.ArgumentParser(prog="fastformer-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", nargs="+", choices=suites, default=suites, help="suites to run")
    p.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=["fp32", "bf16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="the first shapes of each suite only")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    p.add_argument("--json", metavar="PATH", help="write machine-readable rows")
    p.add_argument("--plot", metavar="PATH", help="write a speedup plot (needs matplotlib)")
    args = p.parse_args(argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
