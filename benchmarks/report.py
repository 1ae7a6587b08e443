"""What fastformer-bench prints and writes from its rows: the per-suite tables, the summary
with its verdict, the JSON file, the comparison of two JSON files and the speedup plot.

* Summary: per suite the geometric mean, over the suite's cases, of ours' speedup against each
  baseline (every candidate whose name does not start with "ours"; "ours_*" candidates are our
  own variants), and every case's max error against the suite's tolerance (Row.passed). The
  run fails (fastformer-bench exits 1) if any case's error is over its tolerance or not finite.
* JSON: {"meta": machine, versions, peaks, the run's options; "rows": every Row field}, the
  rows' rounds_ms being the figure of every timed round (their spread is the run's noise).
* Compare: the rows of two JSON files matched by (suite, case, dtype, mode); per case the
  ratio B / A of each candidate's median time. A candidate "moved" when that ratio leaves the
  noise band both runs recorded: |ln(B / A)| > noise(A) + noise(B), noise being half the
  relative range (max - min) / median of the candidate's rounds in that run.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, fields
from typing import Optional

from .common import Row

SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


def baselines_of(rows: list) -> list:
    """The candidates ours is compared to: every timed name not starting with "ours"."""
    return sorted({k for r in rows for k in r.times_ms if not k.startswith("ours")})


def geomean(values: list) -> Optional[float]:
    values = [v for v in values if v is not None and v > 0]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def noise(samples: list) -> Optional[float]:
    """Half the relative range of a candidate's round figures: (max - min) / (2 * median)."""
    if not samples:
        return None
    return (max(samples) - min(samples)) / (2 * statistics.median(samples))


def _rate(r: Row) -> Optional[float]:
    t = r.times_ms.get("ours")
    if not t:
        return None
    if "flops" in r.work:
        return r.work["flops"] / (t * 1e-3) / 1e9
    if "bytes" in r.work:
        return r.work["bytes"] / (t * 1e-3) / 1e9
    return None


def _peak_for(r: Row, peaks: dict) -> Optional[float]:
    if not peaks:
        return None
    if "flops" in r.work:
        return peaks.get("matmul_gflops", {}).get(r.dtype)
    if "bytes" in r.work:
        return peaks.get("copy_gbps")
    return None


def _verdict(r: Row) -> str:
    return {True: "ok", False: "FAIL", None: "-"}[r.passed]


def _grid(head: list, lines: list, left: tuple = ()) -> str:
    """Fixed-width columns, right-aligned but for the indices in `left`."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]

    def fmt(cells):
        return "  ".join(str(c).ljust(w) if i in left else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in lines])


def format_table(rows: list, peaks: Optional[dict] = None) -> str:
    """One suite's fixed-width table: times, speedups vs each baseline, throughput and its
    share of the dtype's matmul peak (or of the copy peak for GB/s rows), error, memory."""
    cands = sorted({k for r in rows for k in r.times_ms if k != "ours"},
                   key=lambda k: (k.startswith("ours"), k))
    unit = "GFLOP/s" if any("flops" in r.work for r in rows) else "GB/s"
    head = ["case", "dtype", "mode", "ours ms", "noise"] + [f"{b} ms" for b in cands]
    head += [f"x{b}" for b in cands] + [unit, "% peak", "max err", "tol", "ok",
                                        "peak MiB (ours/" + "/".join(cands) + ")"]
    lines = []
    for r in rows:
        n = noise(r.rounds_ms.get("ours", []))
        cells = [r.case, SHORT.get(r.dtype, r.dtype), r.mode, f"{r.times_ms.get('ours', float('nan')):.3f}",
                 f"±{100 * n:.0f}%" if n is not None else "-"]
        cells += [f"{r.times_ms[b]:.3f}" if b in r.times_ms else "-" for b in cands]
        cells += [f"{r.ratio(b):.2f}" if r.ratio(b) else "-" for b in cands]
        rate, peak = _rate(r), _peak_for(r, peaks)
        cells.append(f"{rate:.1f}" if rate is not None else "-")
        cells.append(f"{100 * rate / peak:.0f}%" if rate is not None and peak else "-")
        cells.append(f"{r.max_err:.2e}" if r.max_err is not None else "-")
        cells.append(f"{r.tolerance:.2g}" if r.tolerance is not None else "-")
        cells.append(_verdict(r))
        mem = [r.peak_mb.get(k) for k in ["ours"] + cands]
        cells.append("/".join("-" if m is None else f"{m:.0f}" for m in mem))
        lines.append(cells)
    notes = [f"  note [{r.case} {r.dtype} {r.mode}]: {r.note}" for r in rows if r.note]
    return "\n".join([_grid(head, lines)] + notes)


def format_peaks(peaks: dict) -> str:
    mm = ", ".join(f"{SHORT.get(k, k)} {v:.0f}" for k, v in peaks["matmul_gflops"].items())
    return f"matmul GFLOP/s (torch.mm) {mm}; copy {peaks['copy_gbps']:.1f} GB/s"


def summary(rows: list, tolerance_notes: Optional[dict] = None) -> tuple:
    """(text, ok): per suite the geometric-mean speedups and the error verdicts; ok is False
    when any row's error is over its tolerance (or not finite)."""
    tolerance_notes = tolerance_notes or {}
    suites = list(dict.fromkeys(r.suite for r in rows))
    lines, failures, checked = [], [], 0
    table = []
    for suite in suites:
        sub = [r for r in rows if r.suite == suite]
        speed = []
        for b in baselines_of(sub):
            ratios = [r.ratio(b) for r in sub if r.ratio(b)]
            g = geomean(ratios)
            if g is not None:
                part = f"{g:.2f}x {b}"
                speed.append(part + (f" ({len(ratios)} of {len(sub)})" if len(ratios) < len(sub) else ""))
        verdicts = [r.passed for r in sub]
        judged = [v for v in verdicts if v is not None]
        checked += len(judged)
        failures += [r for r in sub if r.passed is False]
        errs = f"{sum(judged)}/{len(judged)} pass" if judged else "none checked"
        if len(judged) < len(sub):
            errs += f", {len(sub) - len(judged)} unchecked"
        table.append([suite, str(len(sub)), ", ".join(speed) or "-", errs])
    lines.append(_grid(["suite", "cases", "speedup of ours (geometric mean)", "max err <= tolerance"],
                       table, left=(0, 2, 3)))
    lines.append("tolerances (max |ours - reference|, the numerical policy of ARCHITECTURE.md):")
    for suite in suites:
        tols = {}
        for r in rows:
            if r.suite == suite and r.tolerance is not None:
                tols.setdefault(SHORT.get(r.dtype, r.dtype), set()).add(r.tolerance)
        text = ", ".join(f"{d} " + "/".join(f"{t:.2g}" for t in sorted(v)) for d, v in tols.items())
        note = tolerance_notes.get(suite)
        lines.append(f"  {suite}: {text or 'none'}" + (f" ({note})" if note else ""))
    for r in failures:
        lines.append(f"FAIL {r.suite}: {r.case} {r.dtype} {r.mode}: max err {r.max_err:.3g} > "
                     f"tolerance {r.tolerance:.3g}")
    ok = not failures
    lines.append(f"verdict: {'PASS' if ok else 'FAIL'}: {checked - len(failures)} of {checked} "
                 f"checked cases within tolerance")
    return "\n".join(lines), ok


# ---- JSON ---------------------------------------------------------------------------------------
def write_json(path: str, rows: list, meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [dict(asdict(r), passed=r.passed) for r in rows]}, f, indent=1)


def read_json(path: str) -> tuple:
    """(meta, rows) of a file write_json wrote; ValueError naming the file if it is not one."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{path} is not a fastformer-bench --json file (no 'rows' list)")
    names = {f.name for f in fields(Row)}
    try:
        rows = [Row(**{k: v for k, v in r.items() if k in names}) for r in data["rows"]]
    except TypeError as exc:
        raise ValueError(f"{path}: a row is not a fastformer-bench row ({exc})") from None
    return data.get("meta", {}), rows


def compare(path_a: str, path_b: str) -> str:
    """Per-case ratios B / A of two runs' times, flagging those beyond both runs' noise."""
    meta_a, rows_a = read_json(path_a)
    meta_b, rows_b = read_json(path_b)
    key = lambda r: (r.suite, r.case, r.dtype, r.mode)  # noqa: E731
    by_a, by_b = {key(r): r for r in rows_a}, {key(r): r for r in rows_b}
    out = []
    for name, path, meta in (("A", path_a, meta_a), ("B", path_b, meta_b)):
        out.append(f"{name}: {path}: {_machine_line(meta)}")
    lines, moved = [], 0
    for k in [k for k in by_a if k in by_b]:
        a, b = by_a[k], by_b[k]
        cells = [k[0], k[1], SHORT.get(k[2], k[2]), k[3]]
        ours, others = None, []
        for cand in [c for c in a.times_ms if c in b.times_ms and a.times_ms[c] > 0 < b.times_ms[c]]:
            ratio = b.times_ms[cand] / a.times_ms[cand]
            na, nb = noise(a.rounds_ms.get(cand, [])), noise(b.rounds_ms.get(cand, []))
            band = None if na is None or nb is None else na + nb
            flag = ""
            if band is not None and abs(math.log(ratio)) > band:
                flag = " slower" if ratio > 1 else " faster"
                moved += cand == "ours"
            text = f"{ratio:.2f}" + (f" (±{100 * band:.0f}%)" if band is not None else " (noise ?)") + flag
            if cand == "ours":
                ours = [f"{a.times_ms[cand]:.3f}", f"{b.times_ms[cand]:.3f}", text]
            else:
                others.append(f"{cand} {text}")
        if ours is None:
            continue
        verdict = "" if a.passed == b.passed else f"error verdict {_verdict(a)} -> {_verdict(b)}"
        lines.append(cells + ours + ["; ".join(others) or "-", verdict])
    out.append(_grid(["suite", "case", "dtype", "mode", "ours A ms", "ours B ms", "ours B/A (noise)",
                      "baselines B/A (noise)", ""], lines, left=(0, 1, 7, 8)))
    only_a, only_b = [k for k in by_a if k not in by_b], [k for k in by_b if k not in by_a]
    for name, ks in (("A", only_a), ("B", only_b)):
        for k in ks:
            out.append(f"only in {name}: {k[0]} {k[1]} {k[2]} {k[3]}")
    out.append(f"{len(lines)} cases in both runs; ours moved beyond the recorded noise in {moved} "
               "(ratio B / A of median times; noise: half the relative range of each run's rounds, summed)")
    return "\n".join(out)


def _machine_line(meta: dict) -> str:
    where = meta.get("gpu") or meta.get("cpu", "?")
    return (f"{where}, {meta.get('threads', '?')} threads, torch {meta.get('torch', '?')}, "
            f"fastformer {meta.get('fastformer', '?')}")


# ---- plot ---------------------------------------------------------------------------------------
def write_plot(path: str, rows: list, meta: dict) -> None:
    """Speedup bars: per suite the geometric mean of ours' speedup against each baseline, side
    by side, from 1 (up: ours faster) on a log axis, each case's speedup a dot on its bar; the
    machine in the title. Needs matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    suites = list(dict.fromkeys(r.suite for r in rows))
    names = baselines_of(rows)
    colors = {b: plt.get_cmap("tab10")(i % 10) for i, b in enumerate(names)}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(suites) + 2), 4.5))
    labelled, values = set(), [1.0]
    for x, suite in enumerate(suites):
        sub = [r for r in rows if r.suite == suite]
        bars = [(b, [r.ratio(b) for r in sub if r.ratio(b)]) for b in baselines_of(sub)]
        bars = [(b, ratios) for b, ratios in bars if ratios]
        width = 0.8 / max(1, len(bars))
        for i, (b, ratios) in enumerate(bars):
            g, pos = geomean(ratios), x - 0.4 + width * (i + 0.5)
            ax.bar(pos, g - 1.0, width * 0.9, bottom=1.0, color=colors[b],
                   label=None if b in labelled else f"vs {b}")
            ax.plot([pos] * len(ratios), ratios, "k.", ms=3)
            ax.text(pos, max(g, 1.0) * 1.04, f"{g:.2f}x", ha="center", va="bottom", fontsize=7)
            labelled.add(b)
            values += ratios
    ax.set_yscale("log")
    ticks = [t for t in (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
             if min(values) / 2 <= t <= max(values) * 2]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_yticklabels([f"{t:g}x" for t in ticks])
    ax.set_ylim(min(values) / 1.3, max(values) * 1.5)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(suites)))
    ax.set_xticklabels([f"{s}\n({sum(r.suite == s for r in rows)} cases)" for s in suites], fontsize=8)
    ax.set_ylabel("speedup of ours (baseline time / ours)")
    ax.legend(fontsize=7, ncol=min(4, max(1, len(names))), loc="upper right")
    where = meta.get("gpu") or meta.get("cpu", "?")
    run = "every case (--full)" if meta.get("full") else "default cases"
    ax.set_title(f"fastformer-bench, {run}: {where}, {meta.get('threads', '?')} threads, "
                 f"torch {meta.get('torch', '?')}\nbars: geometric mean per suite; dots: cases",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
