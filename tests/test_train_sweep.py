"""A Hydra sweep under torchrun: every job runs on both ranks in the same deterministic directory, the
process group is reused across jobs, and rank 0 writes the sweep summary (Markdown, JSON, PNG)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from synthetic_prep import write_synthetic_prep

from train.sweep import markdown

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.integration
def test_two_by_one_sweep_under_torchrun_writes_summary(tmp_path: Path) -> None:
    prep = write_synthetic_prep(tmp_path / "prep", n_train=8, n_eval=4, min_len=12, max_len=32)
    out = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="disabled")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_port()),
           str(ROOT / "launch" / "train.py"), "-m", "+exp=debug", f"data.dir={prep}", f"out_dir={out}",
           "train.max_steps=2", "train.save_interval=0", "train.export=false", "data.batch_size=2",
           "data.eval_batch_size=2", "data.eval_max_samples=4", "train.ttt_steps=1,2", "train.loss_decay=0.7"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}"

    jobs = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert jobs == ["job0", "job1"]  # nothing else: both ranks used the same (non-timestamped) dirs
    for job, k in (("job0", 1), ("job1", 2)):
        summary = json.loads((out / job / "summary.json").read_text())
        assert summary["finished"] and summary["world_size"] == 2
        assert (summary["ttt_steps"], summary["loss_decay"]) == (k, 0.7)
        assert len(summary["eval"]["acc_k"]) == k
        assert (out / job / "train.rank1.log").exists() and (out / job / ".hydra" / "config.yaml").exists()

    rows = json.loads((out / "sweep_summary.json").read_text())
    assert [(row["K"], row["lambda"]) for row in rows] == [(1, 0.7), (2, 0.7)]
    assert all(row["sim_tau"] >= 1.0 and row["status"] == "finished" for row in rows)
    table = (out / "sweep_summary.md").read_text()
    assert table == markdown(rows) and "acc_1" in table and table.count("\n") == 4
    assert (out / "sweep_summary.png").stat().st_size > 1000


def test_training_clock_leaves_the_evaluations_out() -> None:
    from train.metrics import training_clock

    records = [
        {"kind": "eval", "step": 0, "time": 100.0},  # the clock starts when the step-0 eval ends
        {"kind": "train", "step": 1, "time": 110.0},
        {"kind": "train", "step": 2, "time": 120.0},
        {"kind": "eval", "step": 2, "time": 150.0},  # 30 s of evaluation after step 2
        {"kind": "train", "step": 3, "time": 160.0},
        {"kind": "train", "step": 3, "time": 999.0},  # a resumed run repeating step 3 keeps the first time
        {"kind": "summary", "step": 3, "time": 170.0},
    ]
    assert training_clock(records) == {1: 10.0, 2: 20.0, 3: 30.0}
    assert training_clock([{"kind": "eval", "step": 0, "time": 1.0}]) == {}


def test_equal_wall_budget_from_a_calibration_run(tmp_path: Path) -> None:
    """bench/compare_drafters.py gives a variant the steps that fit the reference's training seconds, timed per
    token by a finished calibration run of its own recipe (its first step left out): a step of the full run costs
    the batch's mean tokens, whatever lengths the calibration's few batches happened to draw."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import compare_drafters as cd
    from synthetic_prep import write_synthetic_prep

    from data_prep.shards import ShardSet

    prep = write_synthetic_prep(tmp_path / "prep", n_train=12, n_eval=2, min_len=8, max_len=40)
    calib = tmp_path / "dflash_calibration"
    calib.mkdir()
    times = [0.0, 10.0, 14.0, 18.0, 22.0, 26.0, 30.0]  # step 1 pays one-off costs; then 4 s per step
    tokens = [0, 50, 100, 300, 100, 300, 200]  # 20 s for the 1,000 tokens of steps 2..6: 0.02 s a token
    rows = [{"kind": "eval", "step": 0, "time": 0.0}]
    rows += [{"kind": "train", "step": s, "time": t, "tokens": n} for s, (t, n) in enumerate(zip(times, tokens)) if s]
    (calib / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (calib / "config.yaml").write_text(f"data:\n  dir: {prep}\n  max_len: 16\n  batch_size: 4\n")
    (calib / "summary.json").write_text(json.dumps({"finished": True}))
    lengths = [min(n, 16) for n in ShardSet(prep / "train", verify="none").lengths()]
    assert max(lengths) == 16 > min(lengths)  # some samples capped at max_len, some shorter
    per_step = 0.02 * 4 * sum(lengths) / len(lengths)
    args = cd.parse_args(["--suite", "dflash", "--prep", str(tmp_path), "--out", str(tmp_path)])
    assert cd.equal_wall_steps(args, "dflash", [], "dflash", budget_s=100.0) == int(100.0 / per_step)


def test_equal_wall_suites_run_their_budget_variant_first() -> None:
    """main() calibrates every other variant to the reference's training seconds, so the reference must lead."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import compare_drafters as cd

    suites = {name: s for name, s in cd.SUITES.items() if "equal_wall" in s}
    assert {"dflash", "depth", "cost"} <= set(suites)
    for name, suite in suites.items():
        assert next(iter(suite["variants"])) == suite["equal_wall"], name


def test_scaling_folds_in_an_earlier_runs_points(tmp_path: Path) -> None:
    """--previous keeps the points of an earlier scaling run (another prep) beside the ones measured now, each
    naming its prep, and fits all of them; a point measured now replaces the earlier one of the same name."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import compare_drafters as cd

    run = tmp_path / "out" / "n400"  # a finished run: main() trains nothing
    run.mkdir(parents=True)
    rows = [{"kind": "train", "step": 1, "time": 1.0, "tokens": 10}, {"kind": "train", "step": 2, "time": 3.0},
            {"kind": "eval", "step": 2, "time": 4.0, "sim_tau": 1.4, "acc_k": [0.3]}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"finished": True, "steps": 2, "eval": {"sim_tau": 1.4}}))
    earlier = {"n100": 1.2, "n200": 1.3, "n400": 9.9}
    previous = tmp_path / "earlier.json"
    previous.write_text(json.dumps({"suite": "scaling", "prep": "/old/prep", "results": {
        name: {"sim_tau": tau, "acc_k": [0.1], "eval_history": [], "decode": {}} for name, tau in earlier.items()}}))
    record = cd.main(["--suite", "scaling", "--prep", str(tmp_path / "new_prep"), "--out", str(tmp_path / "out"),
                      "--points", "400", "--modes", "", "--previous", str(previous)])
    results = record["results"]
    assert {name: r["sim_tau"] for name, r in results.items()} == {"n400": 1.4, "n100": 1.2, "n200": 1.3}
    assert {name: r["prep"] for name, r in results.items()} == {
        "n400": str(tmp_path / "new_prep"), "n100": "/old/prep", "n200": "/old/prep"}
    fit = record["scaling"]["held-out sim τ"]
    assert fit["points"] == [(100, 1.2), (200, 1.3), (400, 1.4)]
    assert abs(fit["fit"]["b"] - 0.1 / math.log(2)) < 1e-9
    with pytest.raises(SystemExit, match="suite 'scaling', not 'depth'"):
        cd.main(["--suite", "depth", "--prep", str(tmp_path), "--out", str(tmp_path / "out"),
                 "--previous", str(previous)])  # refused before anything trains


def test_a_variants_own_overrides_win_over_the_suite_wide_train_args(tmp_path: Path, monkeypatch) -> None:
    """--train-args pins a recipe for every variant, yet EAGLE-1's own lr and each variant's K must survive it:
    Hydra keeps the last value of a key, so the variant's overrides come after --train-args."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import compare_drafters as cd

    seen: list[list[str]] = []

    def fake_run(cmd: list[str], log: Path) -> None:
        seen.append(cmd)
        log.parent.mkdir(parents=True, exist_ok=True)
        (log.parent / "summary.json").write_text(json.dumps({"finished": True}))

    monkeypatch.setattr(cd, "_run", fake_run)
    args = cd.parse_args(["--suite", "quality", "--prep", str(tmp_path), "--out", str(tmp_path / "out"),
                          "--train-args", "train.lr=2e-3 train.ttt_steps=7"])
    cd.train(args, "eagle1", cd.SUITES["quality"]["variants"]["eagle1"], "quality")
    cmd = seen[0]
    last = {k: v for k, v in (a.split("=", 1) for a in cmd if "=" in a)}
    assert last["train.lr"] == "5e-4" and last["train.ttt_steps"] == "1" and last["model"] == "eagle1"
