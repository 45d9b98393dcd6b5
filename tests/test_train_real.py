"""A short real training run on shards of the real embedded target: held-out loss falls, acc_0 rises."""

from __future__ import annotations

from pathlib import Path

from conftest import run_train


def test_short_run_on_embedded_target_learns(smollm2_prep_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    rows = run_train(out, "+exp=debug", f"data.dir={smollm2_prep_dir}", "train.max_steps=40", "train.epochs=100",
                     "train.ttt_steps=3", "train.lr=3e-3", "train.warmup_steps=4", "train.eval_interval=40",
                     "train.save_interval=0", "data.batch_size=2", "data.eval_max_samples=2")
    evals = [r for r in rows if r["kind"] == "eval"]
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and last["step"] == 40
    assert last["loss_k"][0] < 0.7 * first["loss_k"][0]
    assert last["acc_k"][0] > first["acc_k"][0] + 0.1
    assert last["sim_tau"] > first["sim_tau"]
    assert (out / "export" / "model.safetensors").exists()
