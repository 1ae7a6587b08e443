"""``fastformer-bench`` (``python -m fastformer.bench``): the benchmark suites with correctness checks.

Plain ``fastformer-bench`` runs a representative case or two of every suite (about 2 minutes on
a 2-core CPU) on the default device (CUDA if present, else CPU); ``--full`` runs every case
(16-45 minutes on 2-core CPUs). For each case, ours and each PyTorch baseline are timed in
interleaved rounds, then their peak memory measured, and ours' max error against the
reference computed. It prints one table per suite (times, speedups, GB/s or GFLOP/s and their
share of the dtype's measured matmul peak, error, memory), then a summary: per suite the
geometric-mean speedup of ours against each baseline and every case's error against the suite's
tolerance. Exit status 1 if an error is over its tolerance.

    fastformer-bench                                  # representative cases, fp32 and bf16
    fastformer-bench --full --op attention --dtype bf16
    fastformer-bench --full --op attention --match softcap     # the cases with 'softcap' in their name
    fastformer-bench --full --op attention --match window T5   # with either in their name
    fastformer-bench --json run.json --plot speedup.png
    fastformer-bench --compare before.json after.json

Method: benchmarks/common.py and ARCHITECTURE.md ("Benchmark method").
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import statistics
import sys
import time

import torch

from .benchmarks import common, report

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


class NotInDefaultRun(Exception):
    """Raised by the stand-in for a torch.compile baseline in the default run."""


def _skip_compiled_baselines(mod) -> bool:
    """Leave out a suite's torch.compile candidates (each costs tens of seconds of compiling on
    a 2-core CPU); True if the suite has any. models: its COMPILE switch. loss: its build()
    compiles through _compiled_eager(); the stand-in raises when called, which build() reports
    in the row's note ("compiled skipped: NotInDefaultRun: ...")."""
    if hasattr(mod, "COMPILE"):
        mod.COMPILE = False
        return True
    if hasattr(mod, "_compiled_eager"):
        def not_compiled(*args):
            raise NotInDefaultRun("the default run leaves torch.compile out; --full runs it")
        mod._compiled_eager = lambda: not_compiled
        return True
    return False


def _quiet_libraries():
    """transformers prints a progress bar per model load: it would break up ours."""
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def run(args) -> tuple:
    """Runs the cases; returns (rows, ok)."""
    from tqdm import tqdm

    device = args.device
    dtypes = [DTYPES[d] for d in args.dtype]
    modules = {suite: importlib.import_module(f"fastformer.benchmarks.{suite}") for suite in args.op}
    skipped_compile = [s for s, m in modules.items() if not args.full and _skip_compiled_baselines(m)]
    _quiet_libraries()
    if device == "cpu" and common.steady_allocator():
        print("# glibc malloc: fixed 32 MB mmap threshold, no trimming while timing "
              "(benchmarks/common.py)")
    meta = common.machine_info(device)
    where = meta.get("gpu", meta["cpu"])
    print(f"# fastformer-bench on {device}: {where}, {meta['threads']} threads, torch {meta['torch']}")
    print("# calibrating the peaks ...", flush=True)
    peaks = common.measure_peaks(device, dtypes)
    print(f"# measured peaks: {report.format_peaks(peaks)}")
    jobs = [(suite, mod, case) for suite, mod in modules.items()
            for case in mod.cases(device, dtypes, quick=not args.full)
            if not args.match or any(text in _case_label(mod, case) for text in args.match)]
    if not jobs:
        wanted = " or ".join(repr(text) for text in args.match)
        raise SystemExit(f"fastformer-bench: no case of {', '.join(args.op)} has {wanted} in its name "
                         f"({'every case' if args.full else 'representative cases; --full has more'})")
    print(f"# {len(jobs)} cases ({'every case: --full' if args.full else 'representative cases; --full runs all'})"
          + (f"; torch.compile baselines left out of {', '.join(skipped_compile)} (--full runs them)"
             if skipped_compile else ""), flush=True)

    rows = []
    start = time.time()
    bar = tqdm(jobs, unit="case", dynamic_ncols=True,
               bar_format="{n_fmt}/{total_fmt} cases {bar:16} {elapsed} elapsed, ~{remaining} left | {desc}")
    for suite, mod, case in bar:
        bar.set_description_str(f"{suite}: {_case_label(mod, case)}")
        fns, row, error = mod.build(case)
        row.rounds_ms = common.time_rounds(fns, device)
        row.times_ms = {k: statistics.median(v) for k, v in row.rounds_ms.items()}
        if not args.no_memory:
            row.peak_mb = common.case_memory(fns, device)
        row.max_err = error()
        row.tolerance = common.tolerance(mod, row)
        rows.append(row)
        del fns, error
    bar.close()
    print(f"# {len(rows)} cases in {time.time() - start:.0f} s", flush=True)

    for suite in modules:
        sub = [r for r in rows if r.suite == suite]
        if sub:
            print(f"\n## {suite}")
            print(report.format_table(sub, peaks))
    notes = {s: m.TOLERANCE_NOTE for s, m in modules.items() if hasattr(m, "TOLERANCE_NOTE")}
    text, ok = report.summary(rows, notes)
    print(f"\n## summary ({'--full' if args.full else 'default cases'}, {device}: {where})")
    print(text)
    if skipped_compile:
        print(f"(torch.compile baselines not run in the default run: {', '.join(skipped_compile)}; "
              "--full runs them)")
    meta.update(peaks=peaks, full=args.full, suites=args.op, dtypes=args.dtype, tolerance_notes=notes)
    if args.json:
        report.write_json(args.json, rows, meta)
        print(f"json written to {args.json}")
    if args.plot:
        report.write_plot(args.plot, rows, meta)
        print(f"plot written to {args.plot}")
    return rows, ok


def _case_label(mod, case) -> str:
    name = mod.case_name(case) if hasattr(mod, "case_name") else ""
    return f"{name} {common.dtype_name(case.get('dtype', ''))} {case.get('mode', '')}".strip()


def _check_output_path(p, option: str, path: str):
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        p.error(f"{option} {path}: folder {folder} does not exist")


def main(argv=None) -> int:
    suites = _available_suites()
    p = argparse.ArgumentParser(prog="fastformer-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", nargs="+", choices=suites, default=suites, help="suites to run (default: all)")
    p.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=["fp32", "bf16"],
                   help="dtypes to run (default: fp32 bf16)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--full", action="store_true", help="every case of each suite, not the representative ones")
    p.add_argument("--quick", action="store_true", help="the default (representative cases); kept as an alias")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    p.add_argument("--match", metavar="TEXT", nargs="+", default=[],
                   help="only the cases whose name (as the tables print it, dtype and mode included) "
                        "contains one of the TEXTs, e.g. 'softcap' or 'Llama'")
    p.add_argument("--json", metavar="PATH", help="write the rows, machine, versions and round figures")
    p.add_argument("--plot", metavar="PATH", help="write a speedup plot (needs matplotlib: pip install '.[bench]')")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                   help="compare two --json files (B / A per case) instead of running")
    args = p.parse_args(argv)
    if args.compare:
        try:
            print(report.compare(*args.compare))
        except ValueError as exc:
            p.error(f"--compare: {exc}")
        return 0
    if args.full and args.quick:
        p.error("--quick (the default cases) and --full exclude each other")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    if args.json:
        _check_output_path(p, "--json", args.json)
    if args.plot:
        _check_output_path(p, "--plot", args.plot)
        if importlib.util.find_spec("matplotlib") is None:
            p.error("--plot needs matplotlib: pip install matplotlib (or the '.[bench]' extra)")
    args.op = list(dict.fromkeys(args.op))
    args.dtype = list(dict.fromkeys(args.dtype))
    _, ok = run(args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
