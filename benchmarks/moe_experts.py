"""``ff.moe_ffn``'s experts in bf16 on their two GEMM routes, side by side in one process:
``python -m fastformer.benchmarks.moe_experts N D F E K [ROUNDS]`` (N tokens of width D, E experts
of D -> 2 x F, top-K). The routes: torch's GEMMs (ops/moe.py's ``packed_gemm_wins`` patched to
false) and the packed GEMM where the rule takes it (bf16 on CPUs whose torch bf16 GEMM is generic
code; elsewhere both lines time torch's route). One warm-up call per route, then the median of
ROUNDS (default 3) calls; forward without autograd, then forward + backward."""
from __future__ import annotations

import statistics
import sys
import time

import torch

import fastformer as ff
from fastformer.ops import moe


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (5, 6):
        print(__doc__)
        return 2
    N, D, F_, E, k = (int(a) for a in argv[:5])
    rounds = int(argv[5]) if len(argv) == 6 else 3
    g = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16
    x = torch.randn(N, D, generator=g).to(bf16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g).to(bf16)
    w_gate_up = (torch.randn(E, 2 * F_, D, generator=g) / D ** 0.5).to(bf16)
    w_down = (torch.randn(E, D, F_, generator=g) / F_ ** 0.5).to(bf16)
    d_out = torch.randn(N, D, generator=g).to(bf16)

    def step(train: bool) -> None:
        if not train:
            with torch.no_grad():
                ff.moe_ffn(x, ids, weights, w_gate_up, w_down)
            return
        leaves = [t.detach().requires_grad_() for t in (x, weights, w_gate_up, w_down)]
        ff.moe_ffn(leaves[0], ids, *leaves[1:]).backward(d_out)

    rule = moe.packed_gemm_wins
    try:
        for train in (False, True):
            ms = {}
            for route, wins in (("torch GEMMs", lambda dtype: False), ("packed", rule)):
                moe.packed_gemm_wins = wins
                step(train)
                times = []
                for _ in range(rounds):
                    start = time.perf_counter()
                    step(train)
                    times.append(time.perf_counter() - start)
                ms[route] = statistics.median(times) * 1e3
            print(f"({N}, {D} -> 2x{F_}, {E} experts, top-{k}) bf16 {'fwd+bwd' if train else 'fwd'}: "
                  f"torch GEMMs {ms['torch GEMMs']:.0f} ms, packed {ms['packed']:.0f} ms, "
                  f"{ms['torch GEMMs'] / ms['packed']:.2f}x", flush=True)
    finally:
        moe.packed_gemm_wins = rule
    return 0


if __name__ == "__main__":
    sys.exit(main())
