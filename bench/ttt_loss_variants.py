#!/usr/bin/env python
"""Side-by-side CPU timing of one TTT training step (ttt_loss + backward): fused head vs autograd path.

    python bench/ttt_loss_variants.py --seq-lens 512,1024 --reps 3

Both variants run in ONE process on the same drafter, head and batch (bench/long_context.py's `build`,
teacher "hidden"), interleaved rep by rep, so machine load hits both alike; the number to read is the
ratio, not the seconds. The normalizer is precomputed, as the trainer passes it (count_valid is the
same for both variants and is not timed). Also prints the largest relative gradient difference, a
sanity check at the real geometry (the tests check equality tightly on small ones).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", default="512,1024")
    p.add_argument("--geometry", default="embedded")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--chunk-size", type=int, default=2048)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--in-vocab-boost", type=float, default=1.2, help="scale of the head's draft-vocab rows")
    a = p.parse_args(argv)

    import torch
    from long_context import build

    from train.ttt import TTTSettings, count_valid, ttt_loss

    torch.set_num_threads(a.threads)
    variants = {
        "autograd": TTTSettings(steps=a.steps, chunk_size=a.chunk_size, fused_head=False),
        "fused": TTTSettings(steps=a.steps, chunk_size=a.chunk_size),
    }
    for seq_len in (int(s) for s in a.seq_lens.split(",")):
        args = argparse.Namespace(geometry=a.geometry, dtype=a.dtype, device="cpu", steps=a.steps,
                                  attn="auto", loss_frac=0.8)
        drafter, head, batch, _ = build(args, seq_len)
        with torch.no_grad():  # real draft vocabs cover most targets: put ~95% of teacher argmaxes in it
            head.lm_head.weight[drafter.t2d] *= a.in_vocab_boost
        counts = count_valid(head, batch, variants["fused"], drafter)
        params = [q for q in drafter.parameters() if q.requires_grad]
        times: dict[str, list[float]] = {name: [] for name in variants}
        grads: dict[str, list] = {}
        for _ in range(a.reps):
            for name, settings in variants.items():
                for q in params:
                    q.grad = None
                t0 = time.perf_counter()
                loss, _ = ttt_loss(drafter, head, batch, settings, normalizer=counts)
                loss.backward()
                times[name].append(time.perf_counter() - t0)
                grads[name] = [float(loss.detach()), [q.grad.clone() for q in params]]
        rel = max(
            float((g - r).abs().max() / r.abs().max().clamp_min(1e-30))
            for g, r in zip(grads["fused"][1], grads["autograd"][1])
        )
        med = {name: statistics.median(t) for name, t in times.items()}
        ratios = [t_a / t_f for t_a, t_f in zip(times["autograd"], times["fused"])]
        print(f"T={seq_len} K={a.steps} valid={counts.tolist()} of {int(batch.loss_mask[0, 1:].sum())} "
              f"autograd {med['autograd']:.2f}s fused {med['fused']:.2f}s "
              f"speedup median {statistics.median(ratios):.2f}x (per rep {[round(r, 2) for r in ratios]}) "
              f"loss {grads['autograd'][0]:.6f} vs {grads['fused'][0]:.6f} max rel grad diff {rel:.1e}",
              flush=True)


if __name__ == "__main__":
    main()
