"""data.source=online|hybrid: the frozen target computes the features inside training, so a dump is optional.

train/data.py's sampler, cursor, windows and collate are unchanged: they ask a *sample source* for samples by
index (`lengths()`, `sample_ids()`, `manifest`, `[i]`, optionally `get_many` and `for_epoch`). Offline the source is
the prep's ShardSet. Online it is `OnlineSamples`: the prep's rendered samples (data_prep/rendered.py: token ids and
loss masks, written before its capture; the sampler's lengths come from there) run through the target, one
forward per sample, by prep's own capture (data_prep.capture.capture_samples: the same hooks, the same teacher),
and returned exactly as a shard set returns them once written (data_prep.shards.as_read_back: storage dtypes,
the fp8 round trip). From "captured features" on, online and offline are one code path; a fresh prep lists
its rendered samples in its shards' order, so the two draw the same global batches.

`HybridSamples`: epoch 0 is online and writes every sample this rank owns (its first window; a blank row is
nobody's) into shards with prep's own ShardWriter (atomic, checksummed, resumable) under
<out_dir>/captured/train/. Before epoch 1, every rank closes its writer, the samples still missing (the incomplete
last batch epoch 0 dropped, or what a killed run had buffered) are captured, rank 0 merges the manifests, and the
later epochs read that shard set through ShardSet. A resumed run skips what is recorded: nothing is lost or written
twice.

Everything that would fail later fails before training starts, naming the file and the reason: a prep without
rendered samples, a target that is not the prep's (architecture, geometry, tokenizer, chat template), tap layers
out of its range.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from data_prep.rendered import Rendered, RenderedSet, TargetSource
from data_prep.shards import (
    MANIFEST,
    Manifest,
    Sample,
    ShardError,
    ShardSet,
    ShardSpec,
    ShardWriter,
    as_read_back,
    completed_sample_ids,
    finished_prep,
    merge_manifests,
)
from train.config import DataConfig, DeepSpeedConfig, RunConfig

CAPTURED_DIR = "captured"  # <out_dir>/captured/train: a hybrid run's shard set


class TargetMismatch(ValueError):
    """The target given to online training is not the one the prep rendered its samples for."""


@dataclass
class FrozenTarget:
    """The target with prep's capture hooks on its tap layers, ready to turn rendered samples into shard samples."""

    model: nn.Module
    capture: object  # data_prep.capture.HiddenStateCapture, entered
    head: nn.Module | None  # the compact teachers' head (data_prep.capture.compact_teacher); None: hidden teacher
    spec: ShardSpec
    device: torch.device
    placement: object = None  # what keeps a ZeRO-3 partitioning alive (its DeepSpeed engine); None: a whole copy
    group: object = None  # data.target_placement=tp: the process group the target is split over
    tokenizer: object = None  # its tokenizer with the prep's chat template (rollouts stop at its end of turn)

    def samples(self, rendered: list[Rendered]) -> list[Sample]:
        """The samples as prep's capture writes them (the target's dtype), from ONE forward over `rendered`; split
        over a tensor-parallel group, ONE forward over what every rank of the group passes (a collective: each rank
        calls it as often as the others), and this rank keeps its own."""
        from data_prep.capture import capture_samples

        if self.group is None:
            return capture_samples(self.capture, self.head, self.spec, rendered, self.device)
        import torch.distributed as dist

        parts: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(parts, rendered, group=self.group)
        every = [r for part in parts for r in part]
        got = capture_samples(self.capture, self.head, self.spec, every, self.device) if every else []
        start = sum(len(part) for part in parts[: dist.get_rank(self.group)])
        return got[start : start + len(rendered)]


def check_target_config(config: dict, tokenizer, spec: ShardSpec, where: str) -> None:
    """TargetMismatch naming what differs between the target's config/tokenizer and the prep's `spec` (its
    rendered/spec.json: what its shards' manifest records), before any weight loads."""
    from data_prep.chat import template_hash, tokenizer_hash
    from models.config import check_trainable_target

    text = config.get("text_config", config)
    arch = (config.get("architectures") or [None])[0]
    got = {"architecture": arch, "num_layers": text.get("num_hidden_layers"), "hidden_size": text.get("hidden_size"),
           "vocab_size": text.get("vocab_size")}
    differ = [f"{k} {got[k]} (the prep's: {spec.target.get(k)})" for k in got  # unknown on either side: not compared
              if None not in (got[k], spec.target.get(k)) and got[k] != spec.target.get(k)]
    if tokenizer_hash(tokenizer) != spec.tokenizer_hash:
        differ.append("its tokenizer")
    if template_hash(tokenizer) != spec.chat_template_hash:
        differ.append("its chat template")
    if differ:
        raise TargetMismatch(f"{where}: the target is not the prep's ({spec.target.get('id')}): {', '.join(differ)}")
    try:
        check_trainable_target(config, spec.tap_layers)
    except ValueError as e:
        raise TargetMismatch(f"{where}: tap layers {spec.tap_layers} of the prep on this target: {e}") from e


def load_frozen_target(rendered: RenderedSet, cfg: DataConfig, device: torch.device,
                       partition: Callable[[nn.Module], object] | None = None,
                       ds_cfg: DeepSpeedConfig | None = None) -> FrozenTarget:
    """The frozen target for online training: data.target or the prep's own (rendered/spec.json), checked against
    the prep before its weights load, placed per data.target_placement: replicate (a whole copy), zero3 (`partition`,
    train/engine.py: loaded already partitioned, under `ds_cfg`) or tp (transformers' tensor-parallel plan over
    groups of data.target_tp_size ranks; the target's heads are checked from its config first)."""
    import torch.distributed as dist

    from data_prep.capture import HiddenStateCapture, base_model
    from data_prep.targets import (
        check_tensor_parallel,
        load_target,
        load_target_config,
        load_tokenizer,
        resolve_target,
        target_dtype,
        tensor_parallel_group,
    )
    from models.target_head import TargetHead
    from train.engine import release_freed_memory

    source: TargetSource = rendered.target_source
    ref = cfg.target or source.model
    where = f"data.target={ref}" if cfg.target else f"{rendered.root / 'spec.json'} (target {ref})"
    preset = resolve_target(ref)
    tokenizer = load_tokenizer(preset, source.chat_template)
    spec = rendered.spec
    config = load_target_config(preset)
    check_target_config(config, tokenizer, spec, where)
    tp_size = 1
    if cfg.target_placement == "tp":
        world = dist.get_world_size() if dist.is_initialized() else 1
        tp_size = cfg.target_tp_size or world
        check_tensor_parallel(config, tp_size, world, f"{where}, data.target_tp_size")
    dtype = target_dtype(preset, source.dtype, str(device))  # prep's (resolved for this device if it was auto)
    if partition is not None:  # ZeRO-3: partitioned as it loads (on the ranks' devices), never a whole copy per rank
        from train.engine import full_shape, gathered, partitioned_at_load

        with partitioned_at_load(getattr(torch, dtype), ds_cfg or DeepSpeedConfig()):
            model, _ = load_target(preset, dtype, "cpu", chat_template=source.chat_template)
    else:  # a whole copy goes straight to this rank's device; a tensor-parallel one to each rank's slice of it
        model, _ = load_target(preset, dtype, str(device), chat_template=source.chat_template,
                               tensor_parallel=tp_size)
    weight = model.get_output_embeddings().weight
    rows = (full_shape(weight) if partition is not None else weight.shape)[0]
    if rows != spec.vocab_size:
        raise TargetMismatch(f"{where}: LM head of {rows} rows, the prep's has {spec.vocab_size}")
    head = None
    if spec.teacher != "hidden":  # its own whole copy (gathered from the ZeRO-3 or tensor-parallel shards)
        from models.target_head import final_norm

        whole = contextlib.nullcontext()
        if partition is not None:
            whole = gathered([model.get_input_embeddings().weight, weight, *final_norm(model).parameters()])
        with whole:
            head = copy.deepcopy(TargetHead.from_hf_model(model)).to(device)
    # the LM head stays out of the ZeRO-3 engine: capture never calls it
    placement = partition(base_model(model)) if partition is not None else None
    capture = HiddenStateCapture(model, spec.tap_layers).__enter__()
    release_freed_memory()  # the load's temporaries (a ZeRO-3 load's whole layers, a dtype cast's source), freed
    return FrozenTarget(model, capture, head, spec, device, placement, tensor_parallel_group(model), tokenizer)


class OnlineSamples:
    """A split's rendered samples through the frozen target: the sample source of data.source=online.

    One forward per sample (unpadded), so a sample's features are a function of the sample alone, as in a shard:
    whatever the batch, its padding, the world size or a resume, and bit-identical to a prep that captured sample
    by sample (capture.batch_tokens=1; a batched prep's padding moves fp32 sums, and so a few bf16 roundings).
    batched: one padded forward per call instead, what a ZeRO-3-partitioned target needs (every rank the same
    number of forwards). max_tokens: capture only each sample's first max_tokens (data.overflow=truncate keeps
    no more; the target is causal, so they are what the whole sample's capture gives); None: whole samples."""

    def __init__(self, rendered: RenderedSet, target: FrozenTarget, max_tokens: int | None = None,
                 batched: bool = False):
        self.rendered, self.target, self.max_tokens, self.batched = rendered, target, max_tokens, batched
        self.forward_seconds, self.forward_tokens, self.forwards = 0.0, 0, 0

    def __str__(self) -> str:
        return f"{self.rendered.root} ({self.rendered.spec.target.get('id')} online)"

    @property
    def manifest(self) -> ShardSpec:
        return self.rendered.spec

    def __len__(self) -> int:
        return len(self.rendered)

    def lengths(self) -> list[int]:
        return self.rendered.lengths()

    def sample_ids(self) -> list[str]:
        return self.rendered.sample_ids()

    def captured(self, indices: list[int]) -> list[Sample]:
        """Samples `indices` as prep's capture makes them (each distinct sample once)."""
        distinct = list(dict.fromkeys(indices))
        todo = [self.rendered[i] for i in distinct]
        if self.max_tokens is not None:
            todo = [Rendered(r.conversation_id, r.input_ids[: self.max_tokens], r.loss_mask[: self.max_tokens])
                    for r in todo]
        forwards = [todo] if self.batched else [[r] for r in todo]
        start = time.perf_counter()
        got = dict(zip(distinct, [s for part in forwards for s in self.target.samples(part)]))  # .cpu(): synced
        self.forward_seconds += time.perf_counter() - start
        self.forward_tokens += sum(max(len(r.input_ids) for r in part) * len(part) for part in forwards)  # padded
        self.forwards += len(forwards)
        return [got[i] for i in indices]

    def get_many(self, indices: list[int], owned: list[bool] | None = None) -> list[Sample]:
        return [as_read_back(s, self.manifest) for s in self.captured(indices)]

    def __getitem__(self, i: int) -> Sample:
        return self.get_many([i])[0]

    def stats(self) -> dict:
        dtype = str(next(self.target.model.parameters()).dtype).removeprefix("torch.")
        return {"source": "online", "target_dtype": dtype, "target_forward_s": self.forward_seconds,
                "target_forward_tokens": self.forward_tokens, "target_forwards": self.forwards, "bytes_written": 0}


class _InRenderedOrder:
    """A hybrid run's shard set indexed like the rendered set it was captured from (its shards hold the samples in
    training order): index i is the rendered set's sample i, read through ShardSet."""

    def __init__(self, shards: ShardSet, ids: list[str], lengths: list[int], needed: list[int], spec: ShardSpec):
        self.shards, self.ids, self._lengths, self.manifest = shards, ids, lengths, spec
        self.position = {sid: k for k, sid in enumerate(shards.sample_ids())}
        stored = shards.lengths()
        for i in needed:
            k = self.position.get(ids[i])
            if k is None or stored[k] != lengths[i]:
                raise ShardError(f"{shards.root}: sample {ids[i]!r} is "
                                 f"{'missing' if k is None else 'of another length'} after the hybrid capture")

    def __len__(self) -> int:
        return len(self.ids)

    def lengths(self) -> list[int]:
        return self._lengths

    def sample_ids(self) -> list[str]:
        return self.ids

    def __getitem__(self, i: int) -> Sample:
        return self.shards[self.position[self.ids[i]]]


class HybridSamples:
    """data.source=hybrid (see the module docstring): online in epoch 0, writing shards; a shard set afterwards.
    `online`: OnlineSamples, or train/served.py ServedSamples (data.hybrid_from=vllm)."""

    def __init__(self, online, root: Path, rank: int, world: int, tokens_per_shard: int,
                 verify: str, barrier: Callable[[], None], batch_size: int):
        if online.max_tokens is not None:
            raise ValueError("hybrid capture writes whole samples, as prep does (max_tokens=None)")
        self.online, self.root, self.rank, self.world = online, Path(root), rank, world
        self.tokens_per_shard, self.verify, self.barrier, self.batch_size = tokens_per_shard, verify, barrier, batch_size
        self._writer: ShardWriter | None = None
        self._recorded: set[str] = set()
        self._view: _InRenderedOrder | None = None

    def __str__(self) -> str:
        return f"{self.online} -> {self.root}"

    @property
    def manifest(self) -> ShardSpec:
        return self.online.manifest

    def __len__(self) -> int:
        return len(self.online)

    def lengths(self) -> list[int]:
        return self.online.lengths()

    def sample_ids(self) -> list[str]:
        return self.online.sample_ids()

    def _open(self) -> ShardWriter:
        if self._writer is None:  # what earlier (killed) runs recorded, by any rank, is skipped
            self._writer = ShardWriter(self.root, self.manifest, rank=self.rank, tokens_per_shard=self.tokens_per_shard)
            self._recorded = completed_sample_ids(self.root)
        return self._writer

    def _write(self, samples: list[Sample]) -> None:
        writer = self._open()
        for s in samples:
            if s.sample_id not in self._recorded:
                writer.add(s)
                self._recorded.add(s.sample_id)

    def plan(self, batches: list[list[int]]) -> None:
        """Epoch 0's order, for a live source that asks servers ahead (train/served.py)."""
        ahead = getattr(self.online, "plan", None)
        if ahead is not None:
            ahead(batches)

    def get_many(self, indices: list[int], owned: list[bool] | None = None) -> list[Sample]:
        raw = self.online.captured(indices)
        self._write([s for s, own in zip(raw, owned or [True] * len(raw)) if own])
        return [as_read_back(s, self.manifest) for s in raw]

    def __getitem__(self, i: int) -> Sample:
        return self.get_many([i])[0]

    def for_epoch(self, epoch: int, needed: list[int]):
        """The source of `epoch`: this one (capturing) for epoch 0 unless the shards are complete, else the shard
        set, completed first (COLLECTIVE: every rank calls it at the same epoch)."""
        if self._view is not None:
            return self._view
        complete = (self.root / MANIFEST).exists() and not self._missing(needed)
        if epoch == 0 and not complete:
            return self
        self._complete(needed)
        return self._view

    def _missing(self, needed: list[int]) -> list[int]:
        done = completed_sample_ids(self.root) if self.root.is_dir() else set()
        ids = self.online.sample_ids()
        return [i for i in needed if ids[i] not in done]

    def _complete(self, needed: list[int]) -> None:
        self._open().close()  # this rank's buffer into shards (an empty partial manifest if it wrote none)
        self.barrier()
        missing = self._missing(needed)  # the same list on every rank: every writer has closed
        # Rounds of one capture batch per rank, equal in number on every rank (a ZeRO-3 target's forward is a
        # collective); a rank left without samples in the last round re-runs one it does not write.
        per_round = self.batch_size * self.world
        for start in range(0, len(missing), per_round):
            part = missing[start : start + per_round]
            mine = part[self.rank :: self.world]
            if mine:
                self._write(self.online.captured(mine))
            else:
                self.online.captured(part[:1])
        self._writer.close()
        self._writer = None
        self.barrier()
        if self.rank == 0:
            merge_manifests(self.root)
        self.barrier()
        shards = ShardSet(self.root, verify=self.verify)
        self._view = _InRenderedOrder(shards, self.online.sample_ids(), self.online.lengths(), needed, self.manifest)

    def close(self) -> None:
        """At the end of a run: this rank's buffered samples into shards (recorded, so a resumed or longer run with
        the same out_dir skips them); the shard set itself is merged at the start of epoch 1 (`for_epoch`)."""
        if self._writer is not None:
            self._writer.close()

    def stats(self) -> dict:
        written = self._writer.bytes_written if self._writer is not None else sum(
            p.stat().st_size for p in (self.root / "shards").glob(f"r{self.rank:03d}-*.safetensors"))
        return {**self.online.stats(), "source": "hybrid", "bytes_written": written}


def rendered_splits(prep: Path) -> tuple[RenderedSet, RenderedSet | None]:
    """The prep's rendered train split and its held-out one (None for a prep made with eval_samples=0), checked as
    train/data.py held_out_split checks the shard sets."""
    asked = finished_prep(prep).get("eval_samples_requested")
    train = RenderedSet(prep, "train")
    shards = Path(prep) / "train" / MANIFEST
    if shards.exists() and asdict(Manifest.from_file(shards).spec()) != asdict(train.spec):
        raise ShardError(f"{train.root / 'spec.json'}: another capture than {shards} records (target, taps, teacher "
                         "or hashes): the prep dir mixes two preps; rerun the prep")
    if asked == 0:
        return train, None
    held_out = RenderedSet(prep, "eval")
    if not len(held_out):
        raise ShardError(f"{prep}/rendered: no held-out sample, but the prep was asked for {asked or 'some'} (every "
                         "held-out conversation was dropped: see the prep's summary.json)")
    return train, held_out


def sample_sources(cfg: RunConfig, run_dir: Path, rank: int, world: int, device: torch.device,
                   partition: Callable[[nn.Module], object] | None, barrier: Callable[[], None]
                   ) -> tuple[OnlineSamples | HybridSamples, OnlineSamples | None]:
    """(train, held-out or None) sample sources of data.source=online|hybrid for this data-parallel rank: the
    prep's rendered splits through one frozen target, loaded here once every file and the target are checked."""
    d = cfg.data
    prep = Path(d.dir)
    train_rendered, eval_rendered = rendered_splits(prep)
    if eval_rendered is not None and asdict(eval_rendered.spec) != asdict(train_rendered.spec):
        raise ShardError(f"{prep}/rendered: the train and eval splits were rendered for different captures")
    target = load_frozen_target(train_rendered, d, device, partition, cfg.deepspeed)
    truncate = d.max_len if d.overflow == "truncate" else None
    # zero3: every rank the same number of forwards; tp: one forward over the group's samples (FrozenTarget.samples)
    batched = d.target_placement in ("zero3", "tp")
    held_out = OnlineSamples(eval_rendered, target, truncate, batched) if eval_rendered is not None else None
    if d.source == "online":
        return OnlineSamples(train_rendered, target, truncate, batched), held_out
    root = run_dir / CAPTURED_DIR / "train"
    hybrid = HybridSamples(OnlineSamples(train_rendered, target, None, batched), root, rank, world,
                           d.hybrid_tokens_per_shard, d.verify, barrier, d.batch_size // world)
    return hybrid, held_out
