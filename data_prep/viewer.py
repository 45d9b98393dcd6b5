"""Show a prepared sample with its trained (loss-masked) spans highlighted.

    python -m data_prep.viewer <prep_dir> [--split train|eval] [--index i] [--no-color]
    python -m data_prep.viewer samples.jsonl --tokenizer <dir> [--index i]

A prep dir holds ShardSets under <prep_dir>/<split>/ and the tokenizer saved by prep under
<prep_dir>/tokenizer/. A JSONL file holds one {"input_ids": [...], "loss_mask": [...]} per line (its
tokenizer defaults to a tokenizer/ folder next to the file).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

ON, OFF = "\x1b[30;42m", "\x1b[0m"  # black on green: trained tokens
OPEN, CLOSE = "⟦", "⟧"


def format_sample(
    tokenizer, input_ids: Sequence[int], loss_mask: Sequence[int | bool], color: bool = True
) -> str:
    """The decoded sample; runs of masked tokens in green (color) or between ⟦ ⟧ (no color)."""
    ids, mask = [int(t) for t in input_ids], [bool(m) for m in loss_mask]
    if len(ids) != len(mask):
        raise ValueError(f"input_ids ({len(ids)}) and loss_mask ({len(mask)}) differ in length")
    parts, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            text = tokenizer.decode(
                ids[start:i], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            if mask[start]:
                text = f"{ON}{text}{OFF}" if color else f"{OPEN}{text}{CLOSE}"
            parts.append(text)
            start = i
    return "".join(parts)


def _load_jsonl(path: Path, index: int) -> tuple[str, list[int], list[int]]:
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i == index:
                rec = json.loads(line)
                return str(rec.get("id", rec.get("sample_id", i))), rec["input_ids"], rec["loss_mask"]
    raise IndexError(f"{path} has no line {index}")


def _load_shards(prep: Path, split: str, index: int) -> tuple[str, list[int], list[int]]:
    from data_prep.shards import ShardSet  # lazy: pulls torch/safetensors

    ds = ShardSet(prep / split)
    if not 0 <= index < len(ds):
        raise IndexError(f"{prep / split} has {len(ds)} samples, no index {index}")
    s = ds[index]
    return s.sample_id, s.input_ids.tolist(), s.loss_mask.int().tolist()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data_prep.viewer", description=__doc__.split("\n")[0])
    ap.add_argument("path", type=Path, help="prep dir (ShardSets) or a JSONL of {input_ids, loss_mask}")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--split", choices=("train", "eval"), default="train")
    ap.add_argument("--tokenizer", type=Path, default=None, help="default: <prep_dir>/tokenizer")
    ap.add_argument("--no-color", action="store_true", help="mark trained spans with ⟦ ⟧ instead of color")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    if args.path.is_dir():
        sample_id, ids, mask = _load_shards(args.path, args.split, args.index)
        tok_dir = args.tokenizer or args.path / "tokenizer"
    else:
        sample_id, ids, mask = _load_jsonl(args.path, args.index)
        tok_dir = args.tokenizer or args.path.parent / "tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    color = not args.no_color and sys.stdout.isatty()
    print(f"# sample {sample_id}: {len(ids)} tokens, {sum(map(bool, mask))} trained")
    print(format_sample(tokenizer, ids, mask, color=color))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
