"""The training loop: shards -> TTT loss -> DeepSpeed step, with eval, checkpoints, export, metrics.

One micro-step: this rank's part of the global batch -> count_valid -> all-reduce the counts (the
global normaliser, so the loss of a split batch equals the loss of the whole one) -> ttt_loss ->
engine.backward(loss * world_size) (DeepSpeed averages gradients over ranks; the scaling turns that
back into the sum the global normaliser expects) -> engine.step(). An optimizer step happens at each
accumulation boundary; metrics, evals and checkpoints count optimizer steps.

Sequence parallelism (deepspeed.sequence_parallel_size = P > 1, train/sequence_parallel.py): the data is
sharded over world / P data-parallel ranks (the P ranks of a group read the same batches), each rank
trains its slice of every sequence (`sp.shard`), and the drafter's attention is wrapped before DeepSpeed
sees the model. Counts, metrics and the loss * world scaling stay as they are: every rank is still one
term of the global sums, and DeepSpeed still averages gradients over all ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shutil
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from infra.config_keys import ConfigError
from infra.dirlock import LOCK_FILE, DirLock, claim
from infra.preemption import Preempted, StopSignals, signal_name
from infra.strict_json import dumps
from train import checkpoint
from train.build import init_from_export, load_head
from train.config import RunConfig
from train.data import Cursor, ShardBatches, check_loss_tokens, held_out_split
from train.engine import Engine, init_distributed
from train.export import prep_target
from train.metrics import METRICS_FILE, RUN_SUMMARY, MetricsLogger, memory_stats
from train.objective import Objective, make_objective
from train.sequence_parallel import SequenceParallel, owned_tokens

log = logging.getLogger("train")


# What a run writes into its directory: train.overwrite=true clears exactly these (and refuses a directory that
# holds anything else). Not a run's outputs: Hydra's .hydra/, the logs (*.log: train.log, train.rank<N>.log, a
# bench's log), opened by this launch before training starts, and the lock file. `captured` is train/online.py's
# CAPTURED_DIR; eval/ and eval_<name>/ hold evaluations of the run's export (the Makefile's eval/ and eval_chain/,
# bench/compare_drafters.py's eval_<mode>_t<T>/), stale once the run is cleared.
RUN_OUTPUTS = ("config.yaml", METRICS_FILE, RUN_SUMMARY, "checkpoints", "export", "captured", "wandb", "eval")

# What decides the sample order (train/data.py: which samples, how they are cut and batched, the seed), the
# schedule (its length and shape: train/engine.py), the objective (K, the TTT unroll, and its loss decay) or the
# weights the run started from (train.init_from),
# recorded in every checkpoint's state.json ("settings"). A resume that changes one of them would train some samples
# twice, skip others, bend the lr curve or train another objective, so it is refused, naming the key; a longer
# schedule is allowed on purpose only (train.extend=true: EXTENDABLE). Everything else may change on a resume: the world size and ZeRO stage (checkpoints are
# portable), the eval, logging and save intervals, keep_checkpoints, stop_after_steps, export, the held-out eval's
# settings, data.num_workers, data.verify and the logger.
RESUME_KEYS = (
    "model.method", "data.dir", "data.source", "data.train_samples", "data.batch_size", "data.max_len",
    "data.overflow", "data.split_overlap", "data.bucket", "data.bucket_pool", "train.seed", "train.epochs",
    "train.max_steps", "train.grad_accum", "train.lr", "train.min_lr_ratio", "train.warmup_steps",
    "train.warmup_ratio", "train.schedule", "train.decay_ratio", "train.ttt_steps", "train.loss_decay",
    "train.init_from",
)
# What train.extend=true may raise on a resume: the run goes on past its end, on a schedule recomputed for the new
# length from the step it resumes at (recorded in the checkpoints' and the summary's "extensions").
EXTENDABLE = ("train.max_steps", "train.epochs")


class RunDirError(ConfigError):
    """An out_dir that holds another run's files, or a resume whose settings differ from the checkpoint's."""


def resume_settings(cfg: RunConfig) -> dict:
    """The RESUME_KEYS of `cfg` (data.dir as an absolute path: the same prep however it is spelt)."""
    out = {}
    for key in RESUME_KEYS:
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        out[key] = str(Path(node).resolve()) if key in ("data.dir", "train.init_from") and node else node
    return out


def _longer(old, new) -> bool:
    """Whether a schedule length `new` is longer than `old` (max_steps None: no limit)."""
    if new is None:
        return old is not None
    return old is not None and new > old


def check_resume(cfg: RunConfig, state: dict, where: Path) -> list[dict]:
    """Refuse resuming the checkpoint at `where` (its state.json: `state`) with other sample-order, schedule or
    objective settings (RESUME_KEYS), naming each changed key with its old and new value; with train.extend=true, a
    longer schedule (EXTENDABLE) is taken. Returns the run's extensions: the checkpoint's, and this one's
    ({"at_step", "from", "to"})."""
    extensions = list(state.get("extensions", []))
    saved = state.get("settings")
    if saved is None:
        log.warning("%s records no settings (an older checkpoint): the resume's settings are not compared", where)
        return extensions
    now = resume_settings(cfg)
    changed = {k: (saved[k], now[k]) for k in RESUME_KEYS if k in saved and saved[k] != now[k]}
    if cfg.train.extend:
        longer = {k: v for k, v in changed.items() if k in EXTENDABLE and _longer(*v)}
        if not longer:
            raise RunDirError(f"train.extend=true resumes {where} on a longer schedule: raise train.max_steps or "
                              f"train.epochs past the checkpoint's ({', '.join(f'{k}={saved.get(k)!r}' for k in EXTENDABLE)})")
        for k in longer:
            del changed[k]
        if not changed:
            extensions.append({"at_step": state.get("step"), "from": {k: v[0] for k, v in longer.items()},
                               "to": {k: v[1] for k, v in longer.items()}})
            log.warning("train.extend=true: the run goes on from step %s with %s; the lr schedule is recomputed for "
                        "the new length", state.get("step"), ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in
                                                                        longer.items()))
            return extensions
    if changed:
        hint = (" To continue a finished run past its end on purpose, pass train.extend=true with the longer "
                "train.max_steps or train.epochs." if set(changed) <= set(EXTENDABLE) else "")
        raise RunDirError(f"train.resume=true from {where} with other settings than the run was started with "
                          f"({'; '.join(f'{k}: {a!r} -> {b!r}' for k, (a, b) in changed.items())}): they decide the "
                          "sample order, the schedule or the objective, so the resumed run would not continue it. "
                          "Resume with the run's own values, or start a new run in another out_dir (or with "
                          f"train.overwrite=true).{hint}")
    return extensions


def prepare_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Rank 0, holding the run dir's lock, before anything is written: a fresh run (resume=false) needs a run dir
    without another run's outputs; overwrite=true clears them first (RUN_OUTPUTS only, never foreign files)."""
    if resume or not run_dir.is_dir():
        return
    found = sorted(p.name for p in run_dir.iterdir()
                   if p.name not in (".hydra", LOCK_FILE) and not p.name.endswith(".log"))
    if not found:
        return
    if not overwrite:
        raise RunDirError(f"out_dir {run_dir} holds a previous run's files ({', '.join(found[:8])}"
                          f"{', ...' if len(found) > 8 else ''}): a run directory belongs to one run. Continue that "
                          "run with train.resume=true, clear it with train.overwrite=true, or choose another out_dir")
    foreign = [name for name in found if name not in RUN_OUTPUTS and not name.startswith("eval_")]
    if foreign:
        raise RunDirError(f"train.overwrite=true clears only a run's own files, and out_dir {run_dir} also holds "
                          f"{', '.join(foreign)}: nothing was removed; move them away or choose another out_dir")
    for name in found:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    log.warning("train.overwrite=true: removed the previous run's %s from %s", ", ".join(found), run_dir)


def claim_run_dir(cfg: RunConfig, run_dir: Path, rank: int, world: int) -> DirLock | None:
    """COLLECTIVE. Rank 0 locks `run_dir` (infra/dirlock.py: a second training into it is refused, naming the
    holder's host and pid) and prepares it (`prepare_run_dir`); every rank raises if either is refused."""
    return claim(run_dir, "training", rank, world,
                 check=lambda: prepare_run_dir(run_dir, cfg.train.resume, cfg.train.overwrite))


def total_steps(cfg: RunConfig, batches_per_epoch: int) -> int:
    steps = cfg.train.epochs * batches_per_epoch // cfg.train.grad_accum
    if cfg.train.max_steps is not None:
        steps = min(steps, cfg.train.max_steps)
    if steps < 1:
        raise ValueError(
            f"no optimizer step fits: {batches_per_epoch} batches/epoch x {cfg.train.epochs} epochs "
            f"< grad_accum {cfg.train.grad_accum}"
        )
    return steps


def _all_reduce(x: Tensor) -> Tensor:
    dist.all_reduce(x)
    return x


class Window:
    """Sums over the micro-batches of one optimizer step (already all-reduced over ranks).

    Packed layout (see micro_step): [loss, tokens, *sums[k] for k in keys], each sum of length
    `positions`; "n_valid_k" is the denominator of every "<name>_sum" -> "<name>_k"."""

    def __init__(self, keys: tuple[str, ...], positions: int):
        self.keys, self.positions = keys, positions
        self.reset()

    def reset(self) -> None:
        self.sums = torch.zeros(2 + len(self.keys) * self.positions, dtype=torch.float64)
        self.micro = 0
        self.start = time.perf_counter()

    def add(self, packed: Tensor) -> None:
        self.sums += packed
        self.micro += 1

    def metrics(self) -> dict:
        p, s = self.positions, self.sums
        parts = {k: s[2 + i * p : 2 + (i + 1) * p] for i, k in enumerate(self.keys)}
        n = parts["n_valid_k"].clamp_min(1)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        out = {"loss": float(s[0] / self.micro)}
        for key, v in parts.items():
            if key.endswith("_sum"):
                name = key.removesuffix("_sum")
                out[f"{'loss' if name == 'ce' else name}_k"] = (v / n).tolist()
        out.update(n_valid_k=parts["n_valid_k"].long().tolist(), tokens=int(s[1]), tokens_per_s=float(s[1]) / elapsed)
        return out


def micro_step(
    engine: Engine, module, head, batch, objective: Objective, world: int, sp: SequenceParallel | None = None
) -> tuple[Tensor, tuple]:
    """One micro-batch: forward, backward; returns the all-reduced packed metrics and their keys.
    `sp`: this rank's sequence-parallel place (None = off)."""
    batch = (sp or SequenceParallel()).shard(batch).to(engine.device, engine.dtype)
    counts, state = objective.count(module, head, batch)
    loss, sums = objective.loss(module, head, batch, _all_reduce(counts), state)
    engine.backward(loss * world)
    keys = tuple(sorted(sums))
    packed = torch.cat([
        loss.detach().double().cpu().view(1),
        owned_tokens(batch).double().cpu().view(1),  # a slice's halo is its neighbour's
        *(sums[k].detach().double().cpu().reshape(-1) for k in keys),
    ])
    return _all_reduce(packed.to(engine.device)).cpu(), keys


def evaluate(
    engine: Engine, module, head, data: ShardBatches, objective: Objective, sp: SequenceParallel | None = None,
    live: bool = False,
) -> dict:
    """Held-out metrics over the whole eval subset, every rank on its part, counts all-reduced. live: a source
    whose wait may end in a stop signal (next_batch); Preempted then leaves it on every rank at the same batch."""
    shard = (sp or SequenceParallel()).shard
    batches = (shard(b).to(engine.device, engine.dtype) for b in agreed_batches(data.epoch(0, shuffle=False), live,
                                                                                engine.device))
    sums = objective.eval_sums(module, head, batches)
    return objective.summarize({k: _all_reduce(v.to(engine.device)).cpu() for k, v in sums.items()})


def save_checkpoint(
    engine: Engine, module, run_dir: Path, step: int, cursor: Cursor, cfg: RunConfig, total: int,
    extensions: list[dict] = (),  # type: ignore[assignment]
    rollouts=None,
) -> None:
    """`rollouts`: the on-policy source (train/on_policy.py), whose rollout drafter the checkpoint keeps."""
    state = engine.portable_state()  # collective
    if engine.rank == 0:
        meta = {
            "cursor": dataclasses.asdict(cursor),
            "world_size": engine.world_size,
            "zero_stage": cfg.deepspeed.zero_stage,
            "precision": engine.precision,
            "data_dir": cfg.data.dir,
            "method": cfg.model.method,
            "settings": resume_settings(cfg),  # compared by check_resume
            "total_steps": total,
            "extensions": list(extensions),  # train.extend=true resumes (check_resume)
            "target": prep_target(cfg.data.dir),  # what its export records as the drafter's target
        }
        extra = {}
        if rollouts is not None:  # the drafter the next rollouts draft with, and the step its weights are from
            from train.on_policy import ROLLOUT_PREFIX

            extra = {ROLLOUT_PREFIX + k: v for k, v in rollouts.state().items()}
            meta["rollout_step"] = rollouts.drafter_step
        buffers = export_buffers(module, cfg.model.method)
        path = checkpoint.save(
            run_dir / "checkpoints", step, state, buffers, meta, dataclasses.asdict(module.cfg),
            cfg.train.keep_checkpoints, extra,
        )
        log.info("checkpoint %s", path)
    dist.barrier()


def export_buffers(module, method: str) -> dict[str, Tensor]:
    """What a checkpoint must carry besides the trained parameters: the persistent integer/bool buffers
    (vocab maps) and the frozen parameters that are not the target's own tensors (the family's frozen_keys),
    e.g. an lm_head frozen at the target's rows (kept gathered by ZeRO-3, Objective.keep_gathered, so its
    data is whole on every rank)."""
    from models.registry import family

    frozen_keys = family(method).frozen_keys
    params = {n for n, _ in module.named_parameters()}
    out = {n: b.cpu() for n, b in module.state_dict().items() if not b.is_floating_point() and n not in params}
    for name, p in module.named_parameters():
        if not p.requires_grad and name not in frozen_keys:
            out[name] = p.detach().float().cpu().clone()
    return out


def export(engine: Engine, module, out: Path, method: str, target: dict | None = None) -> None:
    from train.export import export_drafter

    params = engine.full_params()  # collective
    if engine.rank == 0:
        export_drafter(dataclasses.asdict(module.cfg), params, export_buffers(module, method), out, method=method,
                       target=target)
        log.info("export %s", out)
    dist.barrier()


def sample_sources(cfg: RunConfig, run_dir: Path, data_rank: int, data_world: int, resources: ExitStack,
                   signals: StopSignals):
    """(train, held-out or None) of data.source: the prep's shard sets (offline), or its rendered samples through
    the frozen target (online, hybrid: train/online.py) or vLLM's servers (vllm: train/served.py, which enters
    the servers and connections into `resources`), every file and the target checked before training."""
    prep = Path(cfg.data.dir)
    if cfg.data.source == "offline":
        return prep / "train", held_out_split(prep)  # held_out_split names an unfinished prep as such
    if cfg.data.source == "vllm" or cfg.data.hybrid_from == "vllm" and cfg.data.source == "hybrid":
        from train.served import served_sources

        train, held_out = served_sources(cfg, run_dir, dist.get_rank(), dist.get_world_size(), resources,
                                         lambda: signals.received, dist.barrier)
    else:
        from train.engine import device, partition_frozen
        from train.online import sample_sources as online_sources

        partition = None
        if cfg.data.target_placement == "zero3":
            partition = functools.partial(partition_frozen, ds_cfg=cfg.deepspeed)
        train, held_out = online_sources(cfg, run_dir, data_rank, data_world, device(), partition, dist.barrier)
    if cfg.train.on_policy.enabled:  # the prompts rolled out by the drafter against the same target
        from train.on_policy import on_policy_source

        train = on_policy_source(cfg, train)
    return train, held_out


def run(cfg: RunConfig, run_dir: str | Path) -> dict:
    """Train per `cfg`, everything written under `run_dir`; returns the summary (rank 0; {} elsewhere)."""

    t0 = time.perf_counter()
    check_loss_tokens(cfg.data)  # what the prep's shards allow, before any process group or file
    rank, world = init_distributed(cfg.deepspeed.dist_backend, cfg.deepspeed.cpu_shm_comm)
    cfg.validate(world)
    lock = claim_run_dir(cfg, Path(run_dir), rank, world)  # before anything is read or written
    try:
        # SIGTERM/SIGUSR1: checkpoint and exit (infra/preemption.py); `resources`: what the data source holds open
        # (data.source=vllm: its servers), closed however the run ends
        with StopSignals("training") as signals, ExitStack() as resources:
            return _train(cfg, Path(run_dir), rank, world, t0, signals, resources)
    finally:
        if lock is not None:
            lock.release()


def _train(cfg: RunConfig, run_dir: Path, rank: int, world: int, t0: float, signals: StopSignals,
           resources: ExitStack) -> dict:
    sp = SequenceParallel.from_config(cfg)  # collective: every rank creates every group
    data_rank, data_world = sp.data_parallel(rank, world)
    t, prep = cfg.train, Path(cfg.data.dir)
    latest = checkpoint.latest(run_dir / "checkpoints") if t.resume else None
    extensions: list[dict] = []
    if latest is not None:  # refused before the data and the target load
        extensions = check_resume(cfg, json.loads((latest / "state.json").read_text()), latest)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
    train_data, eval_data = open_data(cfg, run_dir, rank, data_rank, data_world, resources, signals)
    steps_total = total_steps(cfg, train_data.batches_per_epoch)
    if rank == 0 and t.warmup(steps_total) >= steps_total:  # the lr never leaves its warmup ramp
        log.warning("the lr warmup (%d optimizer steps) is not shorter than the run (%d steps): the lr never reaches "
                    "train.lr; lower train.warmup_steps or set train.warmup_ratio", t.warmup(steps_total), steps_total)
    ckpt = load_resumed(cfg, latest, steps_total, run_dir)

    torch.manual_seed(t.seed)  # identical initial weights on every rank (ZeRO-3 partitions each rank's copy)
    head = load_head(prep)
    objective = make_objective(cfg)
    drafter = objective.build_drafter(prep, train_data.manifest.tap_layers, head)
    if t.init_from:  # a resume loads the checkpoint's weights over these; the export is checked either way
        info = init_from_export(drafter, t.init_from, prep, head, prep_target(prep))
        if rank == 0:
            log.info("drafter initialised from %s", ", ".join(f"{k} {v}" for k, v in info.items()))
    drafter = sp.apply(drafter)
    engine = Engine(cfg.deepspeed, t, steps_total)
    head.to(engine.device, engine.dtype)
    rollouts = train_data.shards if t.on_policy.enabled else None  # train/on_policy.py: its rollout drafter
    if rollouts is not None:  # a copy of the drafter before the engine partitions it; a resume's from its checkpoint
        from train.on_policy import ROLLOUT_PREFIX

        saved = {} if ckpt is None else {k.removeprefix(ROLLOUT_PREFIX): v for k, v in ckpt.extra.items()
                                         if k.startswith(ROLLOUT_PREFIX)}
        rollouts.start(drafter, engine.device, engine.dtype, ckpt.state.get("rollout_step", 0) if ckpt else 0,
                       saved, head)
    module = engine.prepare(
        drafter, ckpt.engine_state() if ckpt else None, keep_gathered=objective.keep_gathered
    )
    step, cursor = 0, Cursor()
    if ckpt is not None:
        step, cursor = ckpt.state["step"], Cursor(**ckpt.state["cursor"])
        checkpoint.set_rng_state(ckpt.rng)
        log.info("resumed from %s (step %d, saved at world size %d)", ckpt.path, step, ckpt.state["world_size"])
    del ckpt

    logger = MetricsLogger(cfg.logger, run_dir, rank, dataclasses.asdict(cfg), steps_total, step)
    window, last_eval, last_saved, eval_metrics = None, -1, step, None
    tokens_total, stop = 0, 0
    if eval_data is not None and t.eval_interval and step == 0:
        logger.log("eval", 0, evaluate(engine, module, head, eval_data, objective, sp))  # the untrained baseline
    engine.train()
    # a live source's wait may end in a stop signal (its server signalled with it): every rank stops at that batch
    live = cfg.data.source == "vllm" or cfg.data.hybrid_from == "vllm" and cfg.data.source == "hybrid"
    at_step, feature_wait, loop_start = dataclasses.replace(cursor), 0.0, time.perf_counter()
    while not stop and step < steps_total and (t.stop_after_steps is None or step < t.stop_after_steps):
        batches = train_data.epoch(cursor.epoch, cursor.batch)
        while True:
            waited = time.perf_counter()
            batch, cut = next_batch(batches, live, engine.device)
            feature_wait += time.perf_counter() - waited
            if cut:  # back to the last optimizer step: the micro-batches after it are trained again on resume
                stop, cursor = cut, at_step
                break
            if batch is None:
                break
            objective.start_batch(cursor.epoch, cursor.batch)
            cursor.batch += 1
            if cursor.batch == train_data.batches_per_epoch:
                cursor = Cursor(cursor.epoch + 1, 0)
            lr = engine.lr
            packed, keys = micro_step(engine, module, head, batch, objective, world, sp)
            window = window or Window(keys, objective.positions)
            window.add(packed)
            if not engine.step():
                continue
            step += 1
            at_step = dataclasses.replace(cursor)
            if rollouts is not None and step % t.on_policy.refresh_interval == 0:  # collective
                rollouts.refresh(engine.full_params(all_ranks=True), step)
            metrics = window.metrics()
            tokens_total += metrics["tokens"]
            if step % t.log_interval == 0 or step == steps_total:
                if rollouts is not None:  # collective: the rollouts since the last log line, over the ranks
                    metrics.update(rollouts.window_metrics(_all_reduce(rollouts.take_counts().to(engine.device))))
                logger.log("train", step, {**metrics, "lr": lr, "grad_norm": engine.grad_norm,
                                           "epoch": cursor.epoch + cursor.batch / train_data.batches_per_epoch,
                                           **memory_stats()})
            logger.advance()
            aside = time.perf_counter()  # evals and saves are not training steps: out of the loop's time
            if eval_data is not None and t.eval_interval and step % t.eval_interval == 0:
                try:
                    eval_metrics = evaluate(engine, module, head, eval_data, objective, sp, live)
                    logger.log("eval", step, eval_metrics)
                    last_eval = step
                except Preempted as e:  # its servers went with a stop signal: the step is done, saved below
                    stop = e.signum
                engine.train()
            if t.save_interval and step % t.save_interval == 0:
                save_checkpoint(engine, module, run_dir, step, cursor, cfg, steps_total, extensions, rollouts)
                last_saved = step
            loop_start += time.perf_counter() - aside
            # A stop signal seen by any rank stops every rank here, after the same step (one int all-reduced)
            stop = stop or signals.agreed(engine.device)
            window.reset()  # after eval/save, so tokens/s measures training only
            if stop or step >= steps_total or (t.stop_after_steps is not None and step >= t.stop_after_steps):
                break

    loop_s = time.perf_counter() - loop_start
    finished = step >= steps_total
    preempted = stop if not finished else 0  # a signal after the last step changes nothing
    train_data.close()  # hybrid: its buffered samples into shards
    if last_saved != step:
        save_checkpoint(engine, module, run_dir, step, cursor, cfg, steps_total, extensions, rollouts)
    if finished and eval_data is not None and last_eval != step:
        eval_metrics = evaluate(engine, module, head, eval_data, objective, sp)
        logger.log("eval", step, eval_metrics)
    if finished and t.export:
        export(engine, module, run_dir / "export", cfg.model.method, prep_target(cfg.data.dir))
    if rollouts is not None:  # collective: the summary counts every rank's rollouts
        rollouts.set_run_totals(_all_reduce(rollouts.run_totals().to(engine.device)))
    summary = run_summary(cfg, engine, sp, train_data, cursor, step, steps_total, preempted, extensions,
                          eval_metrics, world, t0, tokens_total, (feature_wait, loop_s))
    if rank == 0:
        logger.log("summary", step, summary)
        (run_dir / RUN_SUMMARY).write_text(_json(summary))
        log.info("done: %d/%d steps in %.1f s; held-out sim_tau %s", step, steps_total, summary["wall_s"],
                 None if eval_metrics is None else round(eval_metrics["sim_tau"], 3))
    logger.close()
    engine.destroy()
    if preempted:
        dist.barrier()  # no rank exits before rank 0 has written the summary
        raise Preempted(preempted)
    return summary if rank == 0 else {}


def open_data(cfg: RunConfig, run_dir: Path, rank: int, data_rank: int, data_world: int, resources: ExitStack,
              signals: StopSignals):
    """(the training batches, the held-out batches or None) of this data-parallel rank."""
    train_source, eval_source = sample_sources(cfg, run_dir, data_rank, data_world, resources, signals)
    train_data = ShardBatches(train_source, cfg.data, cfg.data.batch_size, data_rank, data_world,
                              seed=cfg.train.seed, subset=cfg.data.train_samples,
                              all_tokens=cfg.data.loss_tokens == "all")
    eval_data = None
    if eval_source is not None:
        eval_data = ShardBatches(
            eval_source, cfg.data, cfg.data.eval_batch_size, data_rank, data_world,
            max_samples=cfg.data.eval_max_samples, drop_last=False,
        )
    elif rank == 0:
        log.warning("%s was prepared without a held-out split (eval_samples=0): this run trains without "
                    "evaluation (summary.json eval: null)", cfg.data.dir)
    return train_data, eval_data


def load_resumed(cfg: RunConfig, latest: Path | None, steps_total: int, run_dir: Path):
    """The checkpoint a resume continues (None: a fresh run), refused when the run's length changed under it
    without train.extend=true."""
    ckpt = checkpoint.load(latest) if latest is not None else None
    if ckpt is not None and not cfg.train.extend and ckpt.state.get("total_steps", steps_total) != steps_total:
        raise RunDirError(f"train.resume=true from {ckpt.path}: the run has {steps_total} optimizer steps now, "
                          f"{ckpt.state['total_steps']} when it was saved (the prep's sample count changed?)")
    if cfg.train.resume and ckpt is None:
        log.warning("train.resume=true but %s has no checkpoint: starting from scratch", run_dir / "checkpoints")
    return ckpt


def next_batch(batches: Iterator, live: bool, device) -> tuple[object | None, int]:
    """(the next batch or None at the epoch's end, 0) or (None, the signal) when a stop signal ended the wait for it
    (Preempted from a live source). live: COLLECTIVE, the signal agreed by every rank (one int all-reduced), so
    that all stop at the same batch even where some had theirs already."""
    try:
        batch, cut = next(batches, None), 0
    except Preempted as e:
        batch, cut = None, e.signum
    if live and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([cut], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        cut = int(flag.item())
    return (None, cut) if cut else (batch, 0)


def agreed_batches(batches: Iterator, live: bool, device) -> Iterator:
    """`batches` through next_batch: Preempted on every rank at the same batch when a stop signal ended a wait."""
    while True:
        batch, cut = next_batch(batches, live, device)
        if cut:
            raise Preempted(cut)
        if batch is None:
            return
        yield batch


def run_summary(cfg: RunConfig, engine, sp, train_data, cursor: Cursor, step: int, steps_total: int, preempted: int,
                extensions: list[dict], eval_metrics: dict | None, world: int, t0: float, tokens_total: int,
                waits: tuple[float, float]) -> dict:
    """What the run's summary.json says of it; `waits`: (seconds the training loop waited for its batches, the
    loop's seconds, evals and saves left out) on rank 0."""
    t = cfg.train
    feature_wait, loop_s = waits
    return {
        "finished": step >= steps_total,
        "preempted": signal_name(preempted),  # stopped by this signal at `steps`, resumable (exit status 75)
        "steps": step,
        "total_steps": steps_total,
        "extensions": extensions,  # train.extend=true resumes: at which step, from which schedule length to which
        "epoch": cursor.epoch + cursor.batch / train_data.batches_per_epoch,
        "world_size": world,
        "sequence_parallel_size": sp.size,
        "precision": engine.precision,
        "zero_stage": cfg.deepspeed.zero_stage,
        "method": cfg.model.method,
        "ttt_steps": t.ttt_steps,
        "loss_decay": t.loss_decay,
        "eval": eval_metrics,
        "wall_s": time.perf_counter() - t0,
        "tokens": tokens_total,
        # online: the target forward's time; vllm: the requests; bytes written. feature_wait_s: the training loop's
        # time waiting for its next batch (reading shards, the target's forward, vLLM's answers), its share of the loop
        "data": {**train_data.stats(), "feature_wait_s": feature_wait,
                 "feature_wait_share": feature_wait / loop_s if loop_s > 0 else None},
        **memory_stats(),
    }


def _json(x) -> str:

    return dumps(x, indent=1, default=float)
