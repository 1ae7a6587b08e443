"""GPU attention sweep: fastformer's triton (and cuda) backends vs torch's flash SDPA and flash-attn.

    python -m fastformer.benchmarks.gpu_attention [--out results.txt] [--lengths 1024 4096]

(B, H, L, D) = (4, 16, L, 128), bf16, causal and not, forward and forward+backward. Each
candidate is timed with triton.testing.do_bench (median ms) on the same tensors, laid out
(B, L, H, D) as multi-head attention produces them (fastformer and SDPA get the (B, H, L, D)
transposed view, flash-attn the tensor itself). TFLOP/s counts 4*B*H*L*L*D for the forward
(half when causal) and 2.5x that for the backward, the same figure for every candidate. "err"
is the forward's max |out - torch flash SDPA|. Without a CUDA device it says so and exits 0.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

SHAPE = (4, 16, 128)  # B, H, D
LENGTHS = [1024, 2048, 4096, 8192, 16384]


def _candidates() -> dict:
    """name -> fn(q, k, v, causal) on (B, H, L, D) views, for what this machine has."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fastformer as ff

    def fastformer_backend(name):
        def run(q, k, v, causal):
            with ff.use_backend(name):
                return ff.attention(q, k, v, causal=causal)
        return run

    def torch_flash(q, k, v, causal):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    out = {"ff-triton": fastformer_backend("triton")}
    if "cuda" in ff.available_backends():
        out["ff-cuda"] = fastformer_backend("cuda")
    out["torch-flash"] = torch_flash
    try:
        from flash_attn import flash_attn_func
        out["flash-attn"] = lambda q, k, v, causal: flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal).transpose(1, 2)
    except ImportError:
        pass
    return out


def _tflops(B, H, L, D, causal, mode, ms) -> float:
    fwd = 4 * B * H * L * L * D / (2 if causal else 1)
    return fwd * (3.5 if mode == "fwd+bwd" else 1.0) / (ms * 1e-3) / 1e12


def sweep(lengths) -> list:
    """Rows of (L, causal, mode, {candidate: (ms, TFLOP/s, err) or reason})."""
    from triton.testing import do_bench
    B, H, D = SHAPE
    candidates = _candidates()
    rows = []
    for L in lengths:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16,
                                     generator=g).transpose(1, 2) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_(True)
        for causal in (False, True):
            with torch.no_grad():
                expected = candidates["torch-flash"](q, k, v, causal).float()
            errors = {}
            for mode in ("fwd", "fwd+bwd"):
                results = {}
                for name, fn in candidates.items():
                    if mode == "fwd":
                        step = lambda fn=fn: fn(q, k, v, causal)  # noqa: E731
                    else:
                        step = lambda fn=fn: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), dout)  # noqa: E731
                    try:
                        if name not in errors:
                            with torch.no_grad():
                                errors[name] = float((fn(q, k, v, causal).float() - expected).abs().max())
                        ms = do_bench(step, warmup=25, rep=100, return_mode="median")
                        results[name] = (ms, _tflops(B, H, L, D, causal, mode, ms), errors[name])
                    except Exception as e:  # a candidate that cannot run this case
                        results[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
                rows.append((L, causal, mode, results))
                print(format_row(rows[-1]), flush=True)
        del q, k, v, dout
        torch.cuda.empty_cache()
    return rows


def format_row(row) -> str:
    L, causal, mode, results = row
    cells = [f"L={L:<6d} {'causal' if causal else 'full  '} {mode:<8s}"]
    base = results.get("torch-flash")
    for name, r in results.items():
        if isinstance(r, str):
            cells.append(f"{name}: {r}")
            continue
        ms, tflops, err = r
        ratio = f" x{base[0] / ms:.2f}" if isinstance(base, tuple) and name != "torch-flash" else ""
        cells.append(f"{name} {ms:8.3f} ms {tflops:6.1f} TFLOP/s{ratio} err {err:.1e}")
    return " | ".join(cells)


def header() -> str:
    import triton
    B, H, D = SHAPE
    return (f"# GPU attention sweep: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"triton {triton.__version__}\n# (B, H, L, D) = ({B}, {H}, L, {D}) bf16; "
            "x = speedup vs torch-flash (>1: faster); err = max |out - torch-flash| (forward)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastformer.benchmarks.gpu_attention",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", metavar="PATH", help="also append the results to PATH")
    p.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_attention: no CUDA GPU present; nothing to measure.")
        return 0
    print(header(), flush=True)
    start = time.time()
    rows = sweep(args.lengths)
    footer = f"# {len(rows)} rows in {time.time() - start:.0f} s (first calls include autotuning)"
    print(footer)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join([header()] + [format_row(r) for r in rows] + [footer]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
