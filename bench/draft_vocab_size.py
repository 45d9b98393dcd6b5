"""Pick the draft vocabulary size Vd by measurement: coverage of the target's own outputs against the
drafter's step cost, for Vd in {4K, 8K, 16K, 32K, the whole vocabulary}.

    python bench/draft_vocab_size.py --prep outputs/prep/smollm2-135m-instruct --num-prompts 80

For each Vd the vocabulary is cut from the prep's own ranking (data_prep/vocab.py, as model.draft_vocab_size
does) and reported with:
- coverage of the target's greedy MT-bench replies (first turns, `--max-new-tokens`, batched generate in
  float32; cached in --out-dir so a rerun does not regenerate): the share of the tokens the target emits
  that the drafter could propose at all (1 - the online out-of-vocabulary rate);
- coverage of the prep's held-out loss tokens (what the honest held-out metric counts);
- the drafter's step cost on this CPU (1 thread, median of --reps): a drafting step (one forward_step +
  logits over the draft vocabulary for 1 and for 8 tree nodes, no cache) and a training step of the output
  head (fused loss forward + backward over 1,024 rows), each as a ratio to Vd = 32,768.
Writes <out-dir>/draft_vocab_size.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

SIZES = (4096, 8192, 16384, 32768, 0)  # 0: the whole target vocabulary


def target_replies(num_prompts: int, max_new_tokens: int, cache: Path) -> list[list[int]]:
    if cache.exists():
        return json.loads(cache.read_text())
    from data_prep.targets import load_target, resolve_target
    from eval.prompts import load_prompts, render
    from eval.run import stop_token_ids

    preset = resolve_target("smollm2-135m-instruct")
    model, tok = load_target(preset)
    eos = list(stop_token_ids(model, tok))
    prompts = [render(tok, [{"role": "user", "content": r.turns[0]}], {}) for r in load_prompts("mtbench", num_prompts)]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: dict[int, list[int]] = {}
    for start in range(0, len(order), 16):
        idx = order[start:start + 16]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.tensor([[tok.pad_token_id or 0] * (width - len(prompts[i])) + prompts[i] for i in idx])
        attn = (torch.arange(width)[None] >= (width - torch.tensor([len(prompts[i]) for i in idx]))[:, None]).long()
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=tok.pad_token_id or 0)
        for row, i in enumerate(idx):
            seq = gen[row, width:].tolist()
            cut = next((j for j, t in enumerate(seq) if t in eos), len(seq))
            out[i] = seq[: cut + 1] if cut < len(seq) else seq  # the end-of-turn token is emitted too
        print(f"generated {len(out)}/{len(prompts)}", flush=True)
    replies = [out[i] for i in range(len(prompts))]
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(replies))
    return replies


def median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_costs(prep: Path, vd: int, reps: int) -> dict[str, float]:
    from models.eagle3 import Eagle3Config, Eagle3Drafter
    from train.build import target_config
    from train.loss import TeacherRows, VocabMaps, fused_terms

    hf = target_config(prep)
    V = int(hf["vocab_size"])
    vd = vd or V
    cfg = Eagle3Config.from_target_config(hf, draft_vocab_size=vd)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg).eval()
    H = cfg.hidden_size
    taps = torch.randn(1, 8, cfg.fc_in_features)
    ids = torch.randint(0, V, (1, 8))
    out = {}
    for n in (1, 8):
        def draft_step(n=n) -> None:
            with torch.no_grad():
                h = drafter.forward_step(drafter.fuse(taps[:, :n]), ids[:, :n], torch.arange(n))
                torch.topk(torch.log_softmax(drafter.compute_logits(h).float(), -1), 8)
        out[f"draft_step_{n}_s"] = median_s(draft_step, reps)
    rows, perm = 1024, torch.randperm(V)[:vd]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[perm] = True
    maps = VocabMaps.build(torch.sort(perm).values - torch.arange(vd), t2d)
    teacher = TeacherRows("argmax", argmax=torch.sort(perm).values[torch.randint(0, vd, (rows,))])
    h = torch.randn(1, rows, H, requires_grad=True)

    def head_step() -> None:
        loss, *_ = fused_terms(drafter.norm, drafter.lm_head.weight, [h[0]], None, teacher,
                               torch.ones(1, rows, dtype=torch.bool), maps, 1024, torch.ones(1) / rows)
        loss.backward()
    out["train_head_1024_rows_s"] = median_s(head_step, reps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prep", required=True)
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--saved", nargs="*", default=[], help="other preps whose saved draft vocabulary is also "
                    "scored for coverage (e.g. one built by the old rule), on the same replies and held-out split")
    a = ap.parse_args()
    torch.set_num_threads(1)

    from data_prep.shards import ShardSet
    from data_prep.vocab import VOCAB_FILE, draft_vocab_of_size, load_draft_vocab

    prep, out_dir = Path(a.prep), Path(a.out_dir)
    replies = target_replies(a.num_prompts, a.max_new_tokens, out_dir / "mtbench_target_replies.json")
    emitted = torch.tensor([t for r in replies for t in r])
    held_out = torch.cat([s.input_ids[s.loss_mask.bool()] for s in ShardSet(prep / "eval", verify="none")]).long()
    rows = []
    for vd in SIZES:
        _, t2d = draft_vocab_of_size(prep / VOCAB_FILE, vd)
        row = {"draft_vocab_size": int(t2d.sum()), "requested": vd or "whole vocabulary",
               "mtbench_reply_coverage": float(t2d[emitted].double().mean()),
               "held_out_coverage": float(t2d[held_out].double().mean()), **step_costs(prep, vd, a.reps)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    saved = []
    for other in map(Path, a.saved):
        _, t2d = load_draft_vocab(other / VOCAB_FILE)
        saved.append({"prep": str(other), "draft_vocab_size": int(t2d.sum()),
                      "mtbench_reply_coverage": float(t2d[emitted].double().mean()),
                      "held_out_coverage": float(t2d[held_out].double().mean())})
        print(json.dumps(saved[-1]), flush=True)
    ref = next(r for r in rows if r["requested"] == 32768)
    for r in rows:
        for k in ("draft_step_1_s", "draft_step_8_s", "train_head_1024_rows_s"):
            r[k.removesuffix("_s") + "_vs_32k"] = r[k] / ref[k]
    result = {"prep": str(prep), "mtbench_prompts": len(replies), "mtbench_reply_tokens": int(emitted.numel()),
              "held_out_loss_tokens": int(held_out.numel()), "rows": rows, "saved_vocabularies": saved,
              "definitions": {"coverage": "share of tokens inside the draft vocabulary",
                              "cost ratios": "median seconds / the Vd = 32,768 drafter's, 1 thread, same run"}}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "draft_vocab_size.json").write_text(json.dumps(result, indent=1))
    plot(rows, out_dir / "draft_vocab_size.png")
    print(json.dumps(result, indent=1))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["draft_vocab_size"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(xs, [r["mtbench_reply_coverage"] for r in rows], marker="o", label="target's MT-bench replies")
    ax1.plot(xs, [r["held_out_coverage"] for r in rows], marker="s", label="held-out loss tokens")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("draft vocabulary size Vd")
    ax1.set_ylabel("coverage (share of tokens the drafter can propose)")
    ax1.legend()
    for key, label in (("draft_step_1_vs_32k", "draft step, 1 node"), ("draft_step_8_vs_32k", "draft step, 8 nodes"),
                       ("train_head_1024_rows_vs_32k", "training: output head")):
        ax2.plot(xs, [r[key] for r in rows], marker="o", label=label)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("draft vocabulary size Vd")
    ax2.set_ylabel("time / time at Vd = 32,768 (1 thread)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
