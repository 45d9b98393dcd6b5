#!/usr/bin/env python
"""What a verify of M tokens costs in the target's matrix products alone, on this CPU, by GEMM path.

    python bench/projection_gemm.py [--target smollm2-135m-instruct --threads 2 --repeats 7]

The decoder's verify forward is ~70% `aten::mm` (bench/decode_profile.py's operator breakdown), so its cost
against the number of tokens M is set by how the BLAS handles a [M, in] x [in, out] product at small M. This
times the target's own projections (every decoder layer's q, k, v, o, gate, up, down at the sizes of the
target's config; random weights, fp32) and its LM head, at M = 1 ... 33, three ways:
- `linear`: nn.Linear as transformers calls it (x @ W^T, W stored [out, in]: the path the decoder runs);
- `pretransposed`: x @ W^T with W^T materialised contiguous [in, out];
- `onednn`: torch.utils.mkldnn's Linear (oneDNN), input and output converted per call.
Medians of --repeats passes over the whole stack. Writes --out (JSON) and prints it. Nothing else may share
the machine while it runs.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

TOKENS = (1, 2, 3, 4, 5, 9, 17, 33)


def projection_shapes(text_cfg) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's projections: q, k, v, o, gate, up, down."""
    h, inter = text_cfg.hidden_size, text_cfg.intermediate_size
    head_dim = getattr(text_cfg, "head_dim", None) or h // text_cfg.num_attention_heads
    q, kv = text_cfg.num_attention_heads * head_dim, text_cfg.num_key_value_heads * head_dim
    return [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]


def stack_seconds(fns: list[Callable], in_sizes: list[int], m: int, repeats: int) -> float:
    from decode_profile import median_seconds  # bench/ is on sys.path when a bench script runs

    inputs = {size: torch.randn(m, size) for size in set(in_sizes)}

    def once() -> None:
        for fn, size in zip(fns, in_sizes):
            fn(inputs[size])

    return median_seconds(once, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench/results/projection_gemm.json")
    args = ap.parse_args()

    from torch.utils import mkldnn
    from transformers import AutoConfig

    from data_prep.targets import load_target_config, resolve_target

    torch.set_num_threads(args.threads)
    raw = load_target_config(resolve_target(args.target))
    text_cfg = AutoConfig.for_model(**raw).get_text_config()
    shapes = projection_shapes(text_cfg) * int(text_cfg.num_hidden_layers)
    in_sizes = [i for i, _ in shapes]
    layers = [nn.Linear(i, o, bias=False) for i, o in shapes]
    head = nn.Linear(text_cfg.hidden_size, text_cfg.vocab_size, bias=False)

    def pretransposed(linear: nn.Linear) -> Callable:
        weight_t = linear.weight.detach().t().contiguous()
        return lambda x: x @ weight_t

    def onednn(linear: nn.Linear) -> Callable:
        packed = mkldnn.to_mkldnn(linear)
        return lambda x: packed(x.to_mkldnn()).to_dense()

    paths = {
        "linear": [layer.forward for layer in layers],
        "pretransposed": [pretransposed(layer) for layer in layers],
        "onednn": [onednn(layer) for layer in layers],
    }
    result: dict = {
        "target": args.target, "threads": args.threads, "dtype": "float32", "projections": len(shapes),
        "definition": "median seconds of one pass over every decoder layer's projections (and, separately, "
                      "the LM head) at M tokens; ratio = seconds(M) / seconds(1) of the same path",
        "tokens": list(TOKENS),
    }
    with torch.no_grad():
        for name, fns in paths.items():
            secs = [stack_seconds(fns, in_sizes, m, args.repeats) for m in TOKENS]
            result[name] = {"seconds": secs, "ratio_to_1": [s / secs[0] for s in secs]}
        secs = [stack_seconds([head.forward], [text_cfg.hidden_size], m, args.repeats) for m in TOKENS]
        result["lm_head"] = {"seconds": secs, "ratio_to_1": [s / secs[0] for s in secs]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
