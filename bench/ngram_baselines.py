#!/usr/bin/env python
"""What a drafter reaches without the target's features: unigram and bigram predictors of a prep's held-out targets.

    python bench/ngram_baselines.py --prep <prep dir> [--out bench/results/ngram_baselines.json]

Counted on the train split's loss-masked tokens, scored on the held-out split's: top-1 accuracy and cross-entropy
(nats) of predicting x_{t+1} from nothing (unigram) and from x_t alone (bigram, add-one smoothing over the
vocabulary, backing off to the unigram for an unseen x_t). A drafter whose held-out accuracy sits at the
unigram's uses neither the context nor the token before; at the bigram's, only the token before. For DFlash,
x_t is the block's anchor and x_{t+1} block position 1; for EAGLE-3, x_t the last token it embeds.
Prints and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter, defaultdict
from pathlib import Path


def pairs(split_dir: Path):
    """(previous token, target token) for every loss-masked target of a shard split."""
    from data_prep.shards import ShardSet

    shards = ShardSet(split_dir)
    for i in range(len(shards)):
        s = shards[i]
        ids, mask = s.input_ids.tolist(), s.loss_mask.tolist()
        for t in range(1, len(ids)):
            if mask[t]:
                yield ids[t - 1], ids[t]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prep", required=True)
    ap.add_argument("--out", default="bench/results/ngram_baselines.json")
    args = ap.parse_args()
    prep = Path(args.prep)
    vocab = int(json.loads((prep / "summary.json").read_text())["target"]["vocab_size"])

    unigram: Counter = Counter()
    bigram: dict[int, Counter] = defaultdict(Counter)
    for prev, tok in pairs(prep / "train"):
        unigram[tok] += 1
        bigram[prev][tok] += 1
    total = sum(unigram.values())
    top_unigram = unigram.most_common(1)[0][0]
    best_after = {prev: c.most_common(1)[0][0] for prev, c in bigram.items()}

    n = uni_hits = bi_hits = 0
    uni_nll = bi_nll = 0.0
    for prev, tok in pairs(prep / "eval"):
        n += 1
        p_uni = (unigram[tok] + 1) / (total + vocab)
        uni_nll -= math.log(p_uni)
        uni_hits += tok == top_unigram
        after = bigram.get(prev)
        if after is None:
            bi_nll -= math.log(p_uni)
            bi_hits += tok == top_unigram
        else:
            bi_nll -= math.log((after[tok] + p_uni * vocab) / (sum(after.values()) + vocab))
            bi_hits += tok == best_after[prev]
    result = {
        "prep": str(prep), "train_targets": total, "held_out_targets": n,
        "definition": "top-1 accuracy / cross-entropy (nats) on the held-out split's loss-masked targets; counts "
                      "from the train split's; bigram add-one smoothed toward the unigram",
        "unigram": {"accuracy": uni_hits / n, "cross_entropy": uni_nll / n},
        "bigram": {"accuracy": bi_hits / n, "cross_entropy": bi_nll / n},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
