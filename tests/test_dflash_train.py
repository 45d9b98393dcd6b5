"""DFlash training objective: the weighted CE against a naive per-block computation (loss and gradients),
the loss of a batch = the sum of its halves' under the global normaliser, anchors independent of the
batch split / padding / position, tap selection from a superset, the default MASK token, prep taps."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
import torch.nn.functional as F

from models.dflash import DFlashConfig, DFlashDrafter, open_block_attention
from train.batch import Batch
from train.dflash import (
    BlockPlan,
    DFlashObjective,
    DFlashSettings,
    default_mask_token_id,
    draw_anchors,
    prep_tap_layers,
)

torch.set_num_threads(1)
V, H, BS = 48, 32, 5
SETTINGS = DFlashSettings(block_size=BS, anchors=4, gamma=2.0, chunk_size=7, seed=3)


def make_drafter() -> DFlashDrafter:
    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                       vocab_size=V, tap_layers=[0, 2], mask_token_id=V - 1, num_hidden_layers=2,
                       block_size=BS)
    d = DFlashDrafter(cfg)
    torch.nn.init.normal_(d.embed_tokens.weight)
    torch.nn.init.normal_(d.lm_head.weight, std=0.3)
    d.attn_group_rows = 2 * BS  # several attention groups per sequence
    return d


def make_batch(lengths=(22, 17, 30, 9), seed: int = 0, pad_to: int | None = None) -> Batch:
    g = torch.Generator().manual_seed(seed)
    T = pad_to or max(lengths)
    ids = torch.randint(0, V - 1, (len(lengths), T), generator=g)
    valid = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    loss_mask = valid & (torch.arange(T)[None] >= 5)
    loss_mask[0, 12:14] = False  # a gap (a second user turn) inside the response
    ids[~valid] = 0
    return Batch(input_ids=ids, loss_mask=loss_mask, valid=valid, taps=torch.randn(len(lengths), T, 2 * H, generator=g),
                 sample_ids=[f"s{seed}-{i}" for i in range(len(lengths))])


def naive_loss(d: DFlashDrafter, batch: Batch, plan: BlockPlan, settings: DFlashSettings) -> torch.Tensor:
    """Block by block, from the definition: each block alone after its context (positions < anchor)."""
    num, den = 0.0, 0.0
    for b in range(len(batch)):
        T = int(batch.valid[b].sum())
        ctx = d.fuse(batch.taps[b : b + 1])
        context = d.context_kv(ctx, torch.arange(ctx.shape[1])[None])
        for a in plan.anchors[b][plan.keep[b]].tolist():
            ids = torch.full((1, BS), d.mask_token_id)
            ids[0, 0] = batch.input_ids[b, a]
            h = d.forward(ids, torch.arange(a, a + BS)[None], [(k[:, :, :a], v[:, :, :a]) for k, v in context],
                          open_block_attention)
            logits = d.compute_logits(h[0])
            for k in range(1, BS):
                j = a + k
                if j < T and batch.loss_mask[b, j]:
                    w = float(torch.exp(torch.tensor(-(k - 1) / settings.gamma)))
                    num = num + w * F.cross_entropy(logits[k], batch.input_ids[b, j])
                    den += w
    return num / den


def test_weighted_ce_equals_naive_per_block() -> None:
    d, batch = make_drafter(), make_batch()
    obj = DFlashObjective(SETTINGS)
    plan = BlockPlan.build(batch, SETTINGS, draw=11)
    assert plan.keep.sum() == 4 * 3 + 4  # three samples have > 4 candidates, the shortest exactly 4
    loss, sums = obj.loss(d, None, batch, None, plan)
    params = [d.fc.weight, d.norm.weight, d.layers[0].self_attn.k_proj.weight, d.layers[1].mlp.up_proj.weight]
    grads = torch.autograd.grad(loss, params)
    ref = naive_loss(d, batch, plan, SETTINGS)
    ref_grads = torch.autograd.grad(ref, params)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    assert sums["n_valid_k"].tolist() == plan.counts().tolist()
    assert sums["n_valid_k"][0] == plan.keep.sum()  # every block has its first position as a target
    assert (sums["n_valid_k"][:-1] >= sums["n_valid_k"][1:]).all()


def test_halves_add_up_to_the_batch_and_anchors_ignore_the_split() -> None:
    d, batch = make_drafter(), make_batch()
    obj = DFlashObjective(SETTINGS)
    full = BlockPlan.build(batch, SETTINGS, draw=5)
    halves = [dataclasses.replace(batch, **{f: getattr(batch, f)[sl] for f in ("input_ids", "loss_mask", "valid", "taps")},
                                  sample_ids=batch.sample_ids[sl]) for sl in (slice(0, 2), slice(2, 4))]
    plans = [BlockPlan.build(h, SETTINGS, draw=5) for h in halves]
    for sl, plan in zip((slice(0, 2), slice(2, 4)), plans):  # rank r of 2 sees the same anchors as 1 process
        m = plan.anchors.shape[1]
        assert torch.equal(plan.anchors, full.anchors[sl, :m]) and not full.keep[sl, m:].any()
    normalizer = full.counts()
    assert torch.equal(sum(p.counts() for p in plans), normalizer)
    loss, sums = obj.loss(d, None, batch, normalizer, full)
    parts = [obj.loss(d, None, h, normalizer, p) for h, p in zip(halves, plans)]
    torch.testing.assert_close(parts[0][0] + parts[1][0], loss, rtol=1e-5, atol=0)
    for key in ("ce_sum", "acc_sum"):
        torch.testing.assert_close(parts[0][1][key] + parts[1][1][key], sums[key], rtol=1e-5, atol=1e-6)
    g_full = torch.autograd.grad(loss, [d.fc.weight, d.norm.weight])
    g_parts = torch.autograd.grad(parts[0][0] + parts[1][0], [d.fc.weight, d.norm.weight])
    for a, b in zip(g_full, g_parts):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_anchors_depend_on_the_sample_only() -> None:
    batch = make_batch()
    anchors, keep = draw_anchors(batch, 4, seed=3, draw=9)
    padded = make_batch(pad_to=40)  # the same samples padded further (a longer global batch)
    assert torch.equal(draw_anchors(padded, 4, seed=3, draw=9)[0], anchors)
    flipped = dataclasses.replace(batch, **{f: getattr(batch, f).flip(0) for f in ("input_ids", "loss_mask", "valid", "taps")},
                                  sample_ids=batch.sample_ids[::-1])
    assert torch.equal(draw_anchors(flipped, 4, seed=3, draw=9)[0].flip(0), anchors)
    assert not torch.equal(draw_anchors(batch, 4, seed=3, draw=10)[0], anchors)  # another batch position
    assert not torch.equal(draw_anchors(batch, 4, seed=4, draw=9)[0], anchors)  # another train seed
    cand = batch.valid[:, 1:] & batch.loss_mask[:, 1:]
    for b in range(len(batch)):  # anchors are candidates: x_{a+1} is a real response token
        assert cand[b, anchors[b][keep[b]]].all()
    obj = DFlashObjective(SETTINGS)
    obj.start_batch(2, 7)
    assert torch.equal(obj.count(None, None, batch)[1].anchors, BlockPlan.build(batch, SETTINGS,
                       draw=__import__("train.dflash", fromlist=["_seed"])._seed("batch", 2, 7)).anchors)


def test_taps_are_selected_from_a_superset() -> None:
    d, batch = make_drafter(), make_batch()
    obj = DFlashObjective(SETTINGS)
    source = [0, 1, 2, 5]  # a prep for both EAGLE-3 and DFlash; the drafter reads [0, 2]
    wide = torch.cat([batch.taps[..., :H], torch.randn(*batch.taps.shape[:2], H), batch.taps[..., H:],
                      torch.randn(*batch.taps.shape[:2], H)], dim=-1)
    obj.use_taps(d.tap_layers, source)
    assert torch.equal(dataclasses.replace(batch, taps=wide).select_taps(obj.columns, obj.n_source_taps).taps,
                       batch.taps)
    plan = BlockPlan.build(batch, SETTINGS, draw=1)
    assert torch.equal(obj.loss(d, None, dataclasses.replace(batch, taps=wide), None, plan)[0],
                       DFlashObjective(SETTINGS).loss(d, None, batch, None, plan)[0])
    with pytest.raises(ValueError, match="prep-taps"):
        obj.use_taps([0, 3], source)


def test_eval_sums_and_summary() -> None:
    d, batch = make_drafter(), make_batch()
    obj = DFlashObjective(SETTINGS)
    sums = obj.eval_sums(d, None, [batch, make_batch(seed=1)])
    assert torch.equal(sums["n_valid_k"], obj.eval_sums(d, None, [batch, make_batch(seed=1)])["n_valid_k"])
    out = obj.summarize(sums)
    blocks = out["num_blocks"]
    assert blocks == sums["n_valid_k"][0] and out["num_samples"] == 8 and len(out["acc_k"]) == BS - 1
    assert out["sim_tau"] == pytest.approx(1 + float(sums["alpha_num"].sum()) / blocks)
    assert 1.0 <= out["sim_tau"] <= BS
    # alpha_1 = acc_1 (nothing before it); the chain counts never grow along the block
    assert out["alpha_k"][0] == pytest.approx(out["acc_k"][0])
    assert (sums["alpha_den"][1:] <= sums["alpha_num"][:-1]).all()


def test_default_mask_token(smollm2_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert default_mask_token_id(tok, len(tok)) == 16  # "<empty_output>": special, unused by the chat template
    assert default_mask_token_id(tok, len(tok) + 64) == len(tok)  # padded embedding: its first free row
    tok.add_special_tokens({"additional_special_tokens": ["<|MASK|>"]})
    assert default_mask_token_id(tok, len(tok) + 64) == tok.convert_tokens_to_ids("<|MASK|>")


def test_prep_taps_serve_both_drafters() -> None:
    assert prep_tap_layers(30) == [1, 8, 14, 20, 26, 27]  # SmolLM2: EAGLE-3 [1, 14, 26] + DFlash [1, 8, 14, 20, 27]
    assert prep_tap_layers(36) == [1, 9, 17, 25, 32, 33]  # Qwen3-8B


def test_config_composes_and_validates() -> None:
    import warnings

    from hydra import compose, initialize_config_dir

    from train.config import ConfigError, RunConfig, register_configs

    register_configs()
    conf = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(conf, version_base="1.3"):
        def make(*overrides: str) -> RunConfig:
            return RunConfig.from_omegaconf(compose("train", overrides=["data.dir=/x", "out_dir=/y", *overrides]))

        cfg = make("+exp=dflash").validate(2)
        assert cfg.model.method == "dflash"
        assert cfg.data.batch_size == 8 and cfg.train.epochs == 4  # its own demo-sized budget
        # DFlash's own recipe, not EAGLE-3's (issue: DFlash that learns)
        t = cfg.train
        assert (t.lr, t.warmup_ratio, t.clip, t.betas, cfg.model.norm_init) == (6e-4, 0.04, 1.0, [0.9, 0.999],
                                                                                  "target")
        obj = __import__("train.objective", fromlist=["make_objective"]).make_objective(cfg)
        assert isinstance(obj, DFlashObjective) and obj.positions == 15 and obj.settings.anchors == 512
        for bad in ("model.dflash.block_size=1", "model.dflash.mask_token_id=-1", "model.tap_layers=[3,3]",
                    "train.dflash.gamma=0", "train.dflash.anchors=0", "model.dflash.num_layers=0"):
            with pytest.raises(ConfigError, match=re.escape(bad.split("=")[0])):  # the message names the key
                make("model=dflash", bad).validate(1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make("model.dflash.block_size=8").validate(1)  # EAGLE-3 run: a DFlash key is ignored, and says so
        assert any("not used by model.method=eagle3" in str(w.message) for w in caught)


def test_build_drafter_takes_its_taps_from_the_shards(tmp_path) -> None:
    from hydra import compose, initialize_config_dir
    from synthetic_prep import TAP_LAYERS, write_synthetic_prep

    from models.dflash import default_tap_layers
    from train.build import load_head
    from train.config import RunConfig, register_configs

    prep = write_synthetic_prep(tmp_path / "prep", n_train=4, n_eval=2)  # an EAGLE-3 prep: taps [1, 3, 4] of 8
    from safetensors.torch import load_file, save_file

    head_file = str(prep / "target_head.safetensors")
    tensors = load_file(head_file)
    tensors["norm.weight"] = torch.linspace(0.5, 2.0, tensors["norm.weight"].numel())  # a norm that is not 1
    save_file(tensors, head_file)
    register_configs()
    conf = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(conf, version_base="1.3"):
        def build(*overrides: str):
            cfg = RunConfig.from_omegaconf(compose("train", overrides=[f"data.dir={prep}", "out_dir=/y", "model=dflash",
                                                                         "model.dflash.mask_token_id=7", *overrides]))
            obj = DFlashObjective.from_config(cfg.validate(1))
            return obj, obj.build_drafter(prep, TAP_LAYERS, load_head(prep))

        obj, d = build("model.tap_layers=[4,1]")
        assert d.tap_layers == [4, 1] and obj.columns == [2, 0] and d.fc.in_features == 2 * d.cfg.hidden_size
        assert not d.embed_tokens.weight.requires_grad and not d.lm_head.weight.requires_grad
        assert torch.equal(d.lm_head.weight, load_head(prep).lm_head.weight.float())
        assert torch.equal(d.norm.weight, torch.ones_like(d.norm.weight))  # model.norm_init=ones (default)
        _, d = build("model.tap_layers=[4,1]", "model.norm_init=target")
        torch.testing.assert_close(d.norm.weight, load_head(prep).norm.weight.float())
        assert d.norm.weight.requires_grad
        _, d = build("model.tap_layers=[4,1]", "model.norm_init=zeros")  # step 0 predicts uniformly
        assert torch.equal(d.norm.weight, torch.zeros_like(d.norm.weight)) and d.norm.weight.requires_grad
        x = torch.randn(3, d.cfg.hidden_size)
        assert torch.equal(d.lm_head(d.norm(x)), torch.zeros(3, d.lm_head.weight.shape[0]))
        with pytest.warns(UserWarning, match="prep-taps"):  # default [1, 2, 3, 4, 5] not in the shards
            obj, d = build()
        assert default_tap_layers(8) == [1, 2, 3, 4, 5] and d.tap_layers == TAP_LAYERS
        assert d.mask_token_id == 7 and len(d.layers) == 5 and d.block_size == 16
        with pytest.raises(ValueError, match="prep-taps"):
            build("model.tap_layers=[1,2]")


def test_offline_report_covers_dflash_with_every_familys_fields(tmp_path) -> None:
    from hydra import compose, initialize_config_dir
    from synthetic_prep import TAP_LAYERS, write_synthetic_prep

    from data_prep.shards import ShardSet
    from train.batch import collate
    from train.build import load_head
    from train.config import RunConfig, register_configs
    from train.offline import offline_report

    prep = write_synthetic_prep(tmp_path / "prep", n_train=2, n_eval=3)
    register_configs()
    conf = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(conf, version_base="1.3"):
        cfg = RunConfig.from_omegaconf(compose("train", overrides=[
            f"data.dir={prep}", "out_dir=/y", "model=dflash", "model.dflash.mask_token_id=7",
            "model.tap_layers=[4,1]", f"model.dflash.block_size={BS}", "model.dflash.num_layers=2"]))
    obj = DFlashObjective.from_config(cfg.validate(1))
    head = load_head(prep)
    torch.manual_seed(0)
    drafter = obj.build_drafter(prep, TAP_LAYERS, head)
    ds = ShardSet(prep / "eval")
    rep = offline_report(obj, drafter, head, ds, tmp_path / "report", batch_size=2)
    saved = json.loads((tmp_path / "report" / "offline_report.json").read_text())
    direct = obj.summarize(obj.eval_sums(drafter, head, [collate([ds[i] for i in range(len(ds))])]))
    assert saved["method"] == "dflash" and saved["positions"] == BS - 1 and saved["oov_rate"] == 0.0
    assert saved["num_positions"] == saved["n_target_k"][0] == direct["n_valid_k"][0] > 0
    assert saved["acc_k"] == pytest.approx(direct["acc_k"], nan_ok=True) and rep["sim_tau"] >= 1.0
    assert (tmp_path / "report" / "offline_report.png").stat().st_size > 5000


def test_a_rollouts_batch_trains_the_blocks_its_cycles_drafted() -> None:
    """On a rollout's batch (draft_steps) the blocks are the verify cycles' (rooted one past each anchor), each trained
    on the positions the target verified (the accepted drafts and the first rejected one), whatever
    train.dflash.anchors says; the loss is the naive per-block CE over exactly those positions."""
    from train.rollout import Rollout

    d, batch = make_drafter(), make_batch(lengths=(22, 17))
    cycles = {0: [0, 4, 1, 2, 0, 1], 1: [2, 0, 4, 1]}  # accepted drafts per cycle; prompts of 5 tokens
    rollouts = {b: Rollout(5, batch.input_ids[b, : int(batch.valid[b].sum())].tolist(), j, BS - 1)
                for b, j in cycles.items()}
    steps = torch.zeros_like(batch.input_ids)
    for b, r in rollouts.items():
        steps[b, : len(r.tokens)] = r.draft_steps()
    batch = dataclasses.replace(batch, draft_steps=steps)
    obj = DFlashObjective(SETTINGS)
    counts, plan = obj.count(d, None, batch)
    for b, r in rollouts.items():
        roots = [t + 1 for t, _ in r.cycles() if t + 1 < len(r.tokens)]
        assert plan.anchors[b][plan.keep[b]].tolist() == roots  # all of them: more than SETTINGS.anchors
    assert int(plan.keep.sum()) > len(batch) * SETTINGS.anchors
    limit = {(b, t + 1): min(j + 1, BS - 1) for b, r in rollouts.items() for t, j in r.cycles()}
    for b, a, k in plan.valid.nonzero().tolist():
        assert k + 1 <= limit[(b, int(plan.anchors[b, a]))]
    loss, sums = obj.loss(d, None, batch, None, plan)
    num, den = 0.0, 0.0
    for b in range(len(batch)):
        T = int(batch.valid[b].sum())
        context = d.context_kv(d.fuse(batch.taps[b : b + 1]), torch.arange(batch.taps.shape[1])[None])
        for (bb, a), last in limit.items():
            if bb != b or a >= T:
                continue
            ids = torch.full((1, BS), d.mask_token_id)
            ids[0, 0] = batch.input_ids[b, a]
            h = d.forward(ids, torch.arange(a, a + BS)[None], [(k[:, :, :a], v[:, :, :a]) for k, v in context],
                          open_block_attention)
            logits = d.compute_logits(h[0])
            for k in range(1, last + 1):
                if a + k < T and batch.loss_mask[b, a + k]:
                    w = float(torch.exp(torch.tensor(-(k - 1) / SETTINGS.gamma)))
                    num, den = num + w * F.cross_entropy(logits[k], batch.input_ids[b, a + k]), den + w
    torch.testing.assert_close(loss, num / den, rtol=1e-5, atol=1e-6)
    assert sums["n_valid_k"].tolist() == counts.tolist() and counts[0] > counts[-1] > 0
