"""The prep pipeline end to end: real files, crash + resume, 2 ranks, and the real embedded target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_prep
from safetensors.torch import load_file

from data_prep.shards import ShardSet
from data_prep.vocab import load_draft_vocab

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
NO_REGEN = {"regen.enabled": False, "eval_samples": 2, "draft_vocab_size": 32}


def samples_by_id(root: Path) -> dict[str, object]:
    ds = ShardSet(root, verify="eager")
    return {ds[i].sample_id: ds[i] for i in range(len(ds))}


def test_output_layout_and_contents(tiny_prep_dir: Path) -> None:
    summary = json.loads((tiny_prep_dir / "summary.json").read_text())
    train, held_out = samples_by_id(tiny_prep_dir / "train"), samples_by_id(tiny_prep_dir / "eval")
    assert len(train) == summary["samples"]["train"] == 10 and len(held_out) == 2
    assert not set(train) & set(held_out)  # the held-out split is never trained on
    d2t, t2d = load_draft_vocab(tiny_prep_dir / "draft_vocab.safetensors")
    trained = torch.cat([s.input_ids[s.loss_mask] for s in train.values()]).unique()
    vocab = load_file(tiny_prep_dir / "draft_vocab.safetensors")
    # ranked by the train split's tokens AND every other non-held-out conversation of the file, as written
    counted = ((vocab["token_counts"] > 0) | (vocab["dataset_counts"] > 0)).nonzero().flatten()
    assert d2t.numel() == int(t2d.sum()) == counted.numel() > trained.numel()  # fewer distinct tokens than 32000
    assert torch.equal(torch.arange(d2t.numel()) + d2t, counted) and bool(t2d[trained].all())
    assert summary["draft_vocab_count"]["source"] == "dataset" and summary["draft_vocab_count"]["dataset_tokens"] > 0
    regen = [json.loads(line) for f in ("train.r0.jsonl", "eval.r0.jsonl")
             for line in (tiny_prep_dir / "regen" / f).read_text().splitlines()]
    assert len(regen) == 12 and summary["regen"][0]["train"]["total"] == 10
    head = load_file(tiny_prep_dir / "target_head.safetensors")
    assert set(head) == {"embed_tokens.weight", "norm.weight", "lm_head.weight"}
    s = next(iter(train.values()))
    assert s.taps.shape == (len(s), 3 * 32) and summary["tap_layers"] == [1, 3, 4] and s.teacher_hidden.shape == (len(s), 32)
    assert s.loss_mask.any() and not s.loss_mask.all()
    assert summary["bytes_per_token"] == 3 * 32 * 2 + 32 * 2 + 5


CRASH = """
import os, sys
import data_prep.shards as shards
calls = {"n": 0}
real = shards._atomic_write_text
def crash_after_two_shards(path, text):
    calls["n"] += 1
    if calls["n"] == 3:  # third shard: renamed into place, manifest not yet updated -> hard crash
        os._exit(137)
    real(path, text)
shards._atomic_write_text = crash_after_two_shards
from conftest import run_prep
run_prep(sys.argv[1], sys.argv[2], sys.argv[3], num_samples=10, **{"capture.tokens_per_shard": 1,
         "capture.batch_tokens": 64, "regen.enabled": False, "eval_samples": 2, "draft_vocab_size": 32})
"""


def test_crash_then_resume_loses_and_duplicates_nothing(tmp_path, tiny_target_dir, tiny_sharegpt_file) -> None:
    crashed = tmp_path / "crashed"
    proc = subprocess.run([sys.executable, "-c", CRASH, str(crashed), str(tiny_target_dir), str(tiny_sharegpt_file)],
                          env=ENV, capture_output=True, text=True)
    assert proc.returncode == 137, proc.stderr[-2000:]
    assert not (crashed / "train" / "manifest.json").exists()
    assert len(list((crashed / "train" / "shards").iterdir())) == 3  # 2 recorded + 1 orphan
    shard_opts = {"capture.tokens_per_shard": 1, "capture.batch_tokens": 64}
    run_prep(crashed, str(tiny_target_dir), str(tiny_sharegpt_file), num_samples=10, **NO_REGEN, **shard_opts)
    clean = tmp_path / "clean"
    run_prep(clean, str(tiny_target_dir), str(tiny_sharegpt_file), num_samples=10, **NO_REGEN, **shard_opts)
    for split in ("train", "eval"):
        a, b = samples_by_id(crashed / split), samples_by_id(clean / split)
        assert sorted(a) == sorted(b)
        for sid in a:
            assert torch.equal(a[sid].input_ids, b[sid].input_ids)
            assert torch.equal(a[sid].taps, b[sid].taps)


def test_two_ranks_write_the_same_samples(tmp_path, tiny_target_dir, tiny_sharegpt_file) -> None:
    single = tmp_path / "one"
    run_prep(single, str(tiny_target_dir), str(tiny_sharegpt_file), num_samples=10, **NO_REGEN)
    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "launch" / "prep.py"), f"model={tiny_target_dir}", f"data={tiny_sharegpt_file}",
           f"out={out}", "num_samples=10", "eval_samples=2", "draft_vocab_size=32", "regen.enabled=false"]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = {json.loads(p.read_text())["shards"][0]["rank"] for p in (out / "train").glob("manifest.r*.json")}
    assert ranks == {0, 1}
    two, one = samples_by_id(out / "train"), samples_by_id(single / "train")
    assert sorted(two) == sorted(one)
    for sid in one:
        assert torch.equal(two[sid].taps, one[sid].taps)
    assert torch.equal(load_draft_vocab(out / "draft_vocab.safetensors")[0],
                       load_draft_vocab(single / "draft_vocab.safetensors")[0])


@pytest.mark.parametrize("teacher", ["topk", "argmax"])
def test_compact_teachers_match_target_logits(tmp_path, tiny_target_dir, tiny_sharegpt_file, teacher) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / teacher
    run_prep(out, str(tiny_target_dir), str(tiny_sharegpt_file), num_samples=3,
             **{**NO_REGEN, "capture.teacher": teacher, "capture.topk": 5, "capture.taps_dtype": "float8_e4m3fn"})
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    for s in samples_by_id(out / "train").values():
        logits = model(s.input_ids[None]).logits[0]
        if teacher == "argmax":
            assert torch.equal(s.teacher_argmax, logits.argmax(-1))
        else:
            # a valid top-5 (a random tiny model has near-ties that batched fp32 math may reorder)
            kth = logits.topk(5, dim=-1).values[:, -1:]
            chosen = logits.gather(-1, s.teacher_topk_ids)
            assert (chosen >= kth - 1e-4).all() and s.teacher_topk_ids.unique(dim=-1).shape[-1] == 5
            torch.testing.assert_close(s.teacher_topk_logits.float(), chosen, atol=0.02, rtol=0.01)


def test_real_embedded_target_taps_equal_hidden_states(smollm2_prep_dir: Path) -> None:
    """Regenerate with the real SmolLM2, capture, and compare with a plain output_hidden_states forward."""
    from data_prep.targets import load_target, resolve_target

    out = smollm2_prep_dir
    summary = json.loads((out / "summary.json").read_text())
    regen = [json.loads(line) for f in ("train.r0.jsonl", "eval.r0.jsonl")
             for line in (out / "regen" / f).read_text().splitlines()]
    assert len(regen) == 12 and all(r["status"] == "ok" for r in regen)
    preset = resolve_target("smollm2-135m-instruct")
    model, _ = load_target(preset)
    samples = samples_by_id(out / "train")
    assert len(samples) == summary["samples"]["train"] == 10
    for s in list(samples.values())[:4]:
        hs = model(s.input_ids[None], output_hidden_states=True).hidden_states
        for j, layer in enumerate(preset.tap_layers):
            want = hs[layer + 1][0]  # entry 0 is the embedding output
            # bf16 storage; the capture forward ran batched with padding, so fp32 noise may flip a rounding
            torch.testing.assert_close(s.taps[:, j * 576:(j + 1) * 576].float(), want, rtol=1e-2, atol=1e-2)
        logits = model.lm_head(model.model.norm(s.teacher_hidden.float()))
        ref = model(s.input_ids[None]).logits[0]
        agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean()
        assert agree > 0.97  # exact up to the bf16 storage of the final hidden state


def test_stage_vocab_rebuilds_the_draft_vocab_of_a_finished_prep(tiny_prep_dir: Path, tiny_target_dir: Path,
                                                                 tiny_sharegpt_file: Path, tmp_path: Path) -> None:
    import shutil

    out = tmp_path / "prep"
    shutil.copytree(tiny_prep_dir, out)
    before = load_file(out / "draft_vocab.safetensors")
    summary = run_prep(out, str(tiny_target_dir), str(tiny_sharegpt_file), num_samples=10, eval_samples=2,
                       stage="vocab", draft_vocab_size=5, draft_vocab_count="train")
    d2t, t2d = load_draft_vocab(out / "draft_vocab.safetensors")
    assert d2t.numel() == 5 == summary["draft_vocab_size"] == json.loads((out / "summary.json").read_text())[
        "draft_vocab_size"]
    top5 = torch.sort(torch.sort(-before["token_counts"], stable=True).indices[:5]).values  # train split only
    assert torch.equal(torch.arange(5) + d2t, top5)
    assert summary["samples"]["train"] == 10  # the rest of the summary is kept
