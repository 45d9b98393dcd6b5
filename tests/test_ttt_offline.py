"""train/offline.py: report JSON + PNG from a real (tiny) shard set, with an oracle drafter."""

from __future__ import annotations

import json

import pytest
import torch
from ttt_stubs import OracleDrafter, StubHead, vocab

import train.ttt as ttt
from data_prep.shards import Sample, ShardSet, ShardSpec, ShardWriter, merge_manifests
from train.eagle3 import Eagle3Objective
from train.loss import VocabMaps
from train.offline import offline_report
from train.ttt import TTTSettings

V, VD, K = 32, 16, 3


def test_offline_report_oracle(tmp_path, monkeypatch):
    monkeypatch.setattr(ttt, "new_ttt_cache", lambda: None)  # the oracle has no attention
    gen = torch.Generator().manual_seed(0)
    d2t, t2d = vocab(V, VD, gen)
    in_draft = VocabMaps.build(d2t, t2d).draft_to_target
    succ = torch.arange(V)
    succ[in_draft] = in_draft.roll(1)  # a cycle through the draft vocab
    spec = ShardSpec(
        target={"hidden_size": 4, "vocab_size": V, "num_layers": 6}, tap_layers=[1, 2, 3], teacher="argmax"
    )
    writer = ShardWriter(tmp_path / "eval", spec, tokens_per_shard=40)
    lengths = [9, 14, 5, 20, 11]
    for i, T in enumerate(lengths):
        ids = [int(in_draft[i])]
        for _ in range(T - 1):
            ids.append(int(succ[ids[-1]]))
        ids = torch.tensor(ids)
        loss_mask = torch.ones(T, dtype=torch.bool)
        loss_mask[:2] = False  # a "prompt"
        writer.add(Sample(f"s{i}", ids, loss_mask, torch.randn(T, 12).bfloat16(), teacher_argmax=succ[ids]))
    writer.close()
    merge_manifests(tmp_path / "eval")
    ds = ShardSet(tmp_path / "eval")

    out = tmp_path / "report"
    drafter = OracleDrafter(V, d2t, t2d, succ)
    rep = offline_report(Eagle3Objective(TTTSettings(steps=K)), drafter, StubHead(V, V), ds, out, batch_size=2, max_samples=4)
    saved = json.loads((out / "offline_report.json").read_text())
    # valid step-0 targets: j = t+1 with j+1 < T and loss_mask[j+1] -> j in [1, T-2] (mask starts at 2)
    want_pos = sum(T - 2 for T in lengths[:4])
    assert saved["num_samples"] == 4 and saved["num_positions"] == want_pos
    assert saved["acc_k"] == [1.0] * K and saved["alpha_k"] == [1.0] * K
    assert saved["sim_tau"] == pytest.approx(K + 1) and saved["teacher"] == "argmax"
    assert saved["n_valid_k"] == [sum(max(T - 2 - k, 0) for T in lengths[:4]) for k in range(K)]
    assert set(saved) >= {"acc_k", "alpha_k", "sim_tau", "loss_k", "num_samples", "num_positions"}
    assert rep["sim_tau"] == saved["sim_tau"]
    png = (out / "offline_report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
