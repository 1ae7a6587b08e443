"""Train a small encoder-decoder ff.Transformer to reverse digit sequences, on CPU.

    python examples/train_copy_task.py              # ~1 minute on 2 CPU cores
    python examples/train_copy_task.py --steps 50   # a quick look

The source is a random sequence of digits, the target the same digits reversed. The decoder is
trained with teacher forcing (its input is BOS + the target shifted right, under a causal mask);
accuracy is measured by greedy decoding of fresh sequences: a sequence counts only if every
digit is right. Everything below is plain PyTorch except the model's ``ff.`` modules, which are
drop-in replacements of torch.nn's.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from torch import nn

import fastformer as ff

DIGITS, BOS = 10, 10  # tokens 0..9 are digits, 10 starts the decoder input


class Reverser(nn.Module):
    def __init__(self, d_model=64, nhead=4, layers=2, dim_feedforward=128, dropout=0.0):
        super().__init__()
        self.d_model = d_model
        self.embed = nn.Embedding(DIGITS + 1, d_model)
        self.position = ff.SinusoidalPositionalEncoding(d_model, batch_first=True)
        self.transformer = ff.Transformer(d_model, nhead, layers, layers, dim_feedforward, dropout,
                                          batch_first=True, norm_first=True)
        self.head = nn.Linear(d_model, DIGITS)

    def _embed(self, tokens):
        return self.position(self.embed(tokens) * math.sqrt(self.d_model))

    def forward(self, src, tgt_in):
        causal = ff.Transformer.generate_square_subsequent_mask(tgt_in.shape[1])
        hidden = self.transformer(self._embed(src), self._embed(tgt_in), tgt_mask=causal,
                                  tgt_is_causal=True)
        return self.head(hidden)

    @torch.no_grad()
    def greedy(self, src):
        tgt = torch.full((src.shape[0], 1), BOS, dtype=torch.long)
        for _ in range(src.shape[1]):
            next_digit = self(src, tgt)[:, -1].argmax(-1, keepdim=True)
            tgt = torch.cat([tgt, next_digit], dim=1)
        return tgt[:, 1:]


def batch(size, length, generator):
    src = torch.randint(0, DIGITS, (size, length), generator=generator)
    tgt = src.flip(1)
    tgt_in = torch.cat([torch.full((size, 1), BOS), tgt[:, :-1]], dim=1)
    return src, tgt_in, tgt


def progress(step, total, loss, start, width=30):
    done = int(width * step / total)
    rate = step / max(time.perf_counter() - start, 1e-9)
    sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total}  loss {loss:.4f}  "
                     f"{rate:.1f} it/s")
    sys.stdout.flush()
    if step == total:
        sys.stdout.write("\n")


def train(steps=600, batch_size=64, length=8, lr=2e-3, seed=0, eval_size=500, show_progress=True):
    """Returns {"losses": per-step training losses, "accuracy": greedy sequence accuracy}."""
    torch.manual_seed(seed)
    data = torch.Generator().manual_seed(seed)
    model = Reverser()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    loss_fn = nn.CrossEntropyLoss()
    losses, start = [], time.perf_counter()
    model.train()
    for step in range(1, steps + 1):
        src, tgt_in, tgt = batch(batch_size, length, data)
        loss = loss_fn(model(src, tgt_in).reshape(-1, DIGITS), tgt.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if show_progress and (step % 10 == 0 or step == steps):
            progress(step, steps, sum(losses[-10:]) / len(losses[-10:]), start)
    model.eval()
    src, _, tgt = batch(eval_size, length, torch.Generator().manual_seed(seed + 1))
    accuracy = (model.greedy(src) == tgt).all(dim=1).float().mean().item()
    return {"losses": losses, "accuracy": accuracy, "seconds": time.perf_counter() - start}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--length", type=int, default=8, help="digits per sequence")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    result = train(args.steps, args.batch_size, args.length, seed=args.seed)
    print(f"trained {args.steps} steps in {result['seconds']:.0f} s; final loss "
          f"{result['losses'][-1]:.4f}; greedy sequence accuracy on 500 fresh sequences: "
          f"{100 * result['accuracy']:.1f}%")
    return result


if __name__ == "__main__":
    main()
