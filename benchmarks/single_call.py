"""``python -m fastformer.benchmarks.single_call``: single timed calls of the baselines the
interleaved suites skip as too slow.

The suites (``fastformer-bench``) skip a baseline whose estimated call takes longer than their
BUDGET_S, and print the estimate instead: eager bf16 SwiGLU forward+backward at (2048, 4096,
11008) is estimated at ~10 minutes per call on a CPU whose bf16 matmul has no fast path (no
AVX512-BF16/AMX), far too long to repeat in interleaved rounds. This script measures such a case
once, side by side in one process: ours (one warm-up, then the median of three calls), the
baseline once (no warm-up: it would double a call of minutes, and a first call's one-time costs
are milliseconds), then ours three more times, and prints the times, the ratio and the max error
of ours. The figures are single calls, not the suites' interleaved medians; benchmarks/RESULTS.md
says which is which.

    python -m fastformer.benchmarks.single_call --op ffn --match "swiglu" --dtype bf16 --mode fwd+bwd
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch

from ..bench import DTYPES
from . import common


def _time_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastformer.benchmarks.single_call",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", required=True, choices=["attention", "ffn", "layers"])
    p.add_argument("--match", default="", help="substring of the case name (e.g. 'swiglu')")
    p.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=["bf16"])
    p.add_argument("--mode", nargs="+", choices=["fwd", "fwd+bwd"], default=["fwd+bwd"])
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)

    if args.device == "cpu":
        common.steady_allocator()  # the suites' allocator setting (see common.py)
    mod = importlib.import_module(f"fastformer.benchmarks.{args.op}")
    mod.BUDGET_S = float("inf")  # this script exists to run what the suite's budget skips
    print(f"# single calls on {args.device}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    found = 0
    for case in mod.cases(args.device, [DTYPES[d] for d in args.dtype]):
        # Filter before build(): building a case allocates its tensors and, for fwd+bwd ffn
        # cases, runs ours once to count the bytes saved for the backward.
        if case["mode"] not in args.mode or args.match not in mod.case_name(case):
            continue
        fns, row, error = mod.build(case)
        found += 1
        fns["ours"]()  # warm-up
        ours = [_time_once(fns["ours"]) for _ in range(3)]
        baselines = {name: _time_once(fn) for name, fn in fns.items() if name != "ours"}
        ours += [_time_once(fns["ours"]) for _ in range(3)]
        ours_s = statistics.median(ours)
        line = f"{row.case} {row.dtype} {row.mode}: ours {ours_s:.3f} s (6 calls {min(ours):.3f}-{max(ours):.3f})"
        for name, t in baselines.items():
            line += f", {name} {t:.3f} s (1 call) = {t / ours_s:.2f}x"
        gflops = row.work.get("flops", 0) / ours_s / 1e9
        if gflops:
            line += f"; ours {gflops:.0f} GFLOP/s"
        print(line + f"; max err {error():.3g}", flush=True)
    if not found:
        p.error(f"no {args.op} case matches {args.match!r} with dtype {args.dtype} and mode {args.mode}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
