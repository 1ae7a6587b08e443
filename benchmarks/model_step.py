"""One case of the models suite, quickly: ``python -m fastformer.benchmarks.model_step MODEL
DTYPE MODE [CANDIDATES]``, e.g. ``"Llama-style 4x2048 GQA 32/8" bf16 train sdpa,ours``.

The suite's own build() (benchmarks/models.py: same models, inputs and candidates), timed as
single calls: one warm-up call per candidate (it compiles the compiled ones), then ROUNDS rounds
that call every candidate once, in turn; prints the median ms of each, ours' speedup against
each other candidate and the suite's error measure. For a model whose step takes seconds this
is minutes where the whole suite (every model, dtype and mode, the memory pass) is an hour on a
2-core CPU. FASTFORMER_BENCH_COMPILE=0 (the default here) leaves the compiled candidates out.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("FASTFORMER_BENCH_COMPILE", "0")

import torch  # noqa: E402

from . import common, models  # noqa: E402

ROUNDS = int(os.environ.get("FASTFORMER_BENCH_ROUNDS", "3"))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (3, 4) or argv[1] not in DTYPES or argv[2] not in ("inference", "train"):
        print(__doc__)
        return 2
    name, dtype, mode = argv[0], DTYPES[argv[1]], argv[2]
    common.steady_allocator()  # the suite's timing mode (fastformer-bench sets it too)
    fns, _, error = models.build(dict(model=name, dtype=dtype, mode=mode, device="cpu"))
    wanted = argv[3].split(",") if len(argv) == 4 else list(fns)
    unknown = [c for c in wanted if c not in fns]
    if unknown or "ours" not in wanted:
        print(f"candidates must include 'ours' and be among {sorted(fns)}, got {wanted}")
        return 2
    fns = {c: fns[c] for c in wanted}
    for fn in fns.values():
        fn()
    samples = {c: [] for c in fns}
    for _ in range(ROUNDS):
        for c, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[c].append(time.perf_counter() - start)
    ms = {c: 1e3 * statistics.median(v) for c, v in samples.items()}
    speedups = ", ".join(f"{ms[c] / ms['ours']:.2f}x {c}" for c in ms if c != "ours")
    print(f"{name} {argv[1]} {mode}: " + ", ".join(f"{c} {v:.0f} ms" for c, v in ms.items())
          + f"; ours {speedups}; max err {error():.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
