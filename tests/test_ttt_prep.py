"""TTT on real prepared shards (conftest's tiny_prep_dir): ShardSet -> collate -> ttt_loss / offline_report."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from data_prep.shards import ShardSet
from models.eagle3 import Eagle3Config, Eagle3Drafter
from models.target_head import TargetHead
from train.batch import collate
from train.eagle3 import Eagle3Objective
from train.loss import VocabMaps
from train.offline import offline_report
from train.ttt import TTTSettings, count_valid, ttt_loss


def load(prep):
    hf = json.loads((prep / "target_config.json").read_text())
    head = TargetHead.from_file(prep / "target_head.safetensors", hf)
    vd = load_file(str(prep / "draft_vocab.safetensors"))["d2t"].numel()
    train = ShardSet(prep / "train")
    n_taps = len(train.manifest.tap_layers)
    # The tiny 6-layer target's default taps repeat a layer ([1, 2, 2]), which the drafter config refuses;
    # only the fc input width (n_taps * H) matters here.
    cfg = Eagle3Config.from_target_config(hf, draft_vocab_size=vd, tap_layers=list(range(n_taps)))
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    drafter.load_target_embedding(head.embed_tokens_weight.float())
    # A random tiny target's argmaxes are almost never in the data's draft vocab (0 valid positions): draft
    # vocab = the head's most frequent argmaxes on the data, so that positions count and the test means something.
    head = head.float()
    argmax = torch.cat([head.logits(s.teacher_hidden.float()).argmax(-1) for s in train])
    ids, counts = argmax.unique(return_counts=True)
    vd = cfg.draft_vocab_size
    ids = ids[counts.argsort(descending=True)][:vd]
    rest = torch.tensor([i for i in range(cfg.vocab_size) if i not in set(ids.tolist())][: vd - ids.numel()])
    ids = torch.cat([ids, rest.long()]).sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    drafter.set_vocab_mapping(ids - torch.arange(vd), t2d)
    return drafter, head, train


def test_loss_on_real_shards_counts_and_trains(tiny_prep_dir):
    drafter, head, train = load(tiny_prep_dir)
    assert train.manifest.teacher == "hidden"
    batch = collate([train[i] for i in range(4)]).to("cpu", torch.float32)
    settings = TTTSettings(steps=3, chunk_size=64)
    maps = VocabMaps.from_drafter(drafter)
    argmax = head.logits(batch.teacher_hidden).argmax(-1)
    want = []
    for k in range(3):
        n = 0
        for b, T in enumerate(batch.lengths.tolist()):
            for j in range(k + 1, T - 1):
                n += bool(batch.loss_mask[b, j + 1]) and bool(maps.t2d[argmax[b, j]])
        want.append(n)
    assert want[0] >= 15
    assert count_valid(head, batch, settings, drafter).tolist() == want
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(4):
        loss, m = ttt_loss(drafter, head, batch, settings)
        assert m["n_valid_k"].tolist() == want
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]  # a few steps on the same batch must fit it


def test_offline_report_on_real_eval_split(tiny_prep_dir, tmp_path):
    drafter, head, _ = load(tiny_prep_dir)
    ds = ShardSet(tiny_prep_dir / "eval")
    rep = offline_report(Eagle3Objective(TTTSettings(steps=3)), drafter, head, ds, tmp_path, batch_size=2)
    saved = json.loads((tmp_path / "offline_report.json").read_text())
    assert saved["num_samples"] == len(ds) and saved["teacher"] == "hidden"
    # every target row counts (honest metric); those outside the draft vocab are the OOV share
    assert saved["num_positions"] == saved["n_target_k"][0] >= saved["n_valid_k"][0] > 0
    assert saved["oov_rate"] == 1 - saved["n_valid_k"][0] / saved["n_target_k"][0]
    assert 1.0 <= saved["sim_tau"] <= 4.0 and rep["alpha_k"][0] == rep["acc_k"][0]
    assert (tmp_path / "offline_report.png").stat().st_size > 5000
