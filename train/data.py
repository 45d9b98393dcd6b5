"""Shards -> per-rank Batches, through a sampler defined over GLOBAL batches.

The sampler orders the whole train split into global micro-batches of `data.batch_size` samples as a
pure function of (seed, epoch, sample lengths): the world size plays no part. Each global batch is then
split over the ranks (rank r takes members r, r+W, ...), and every rank pads its part to the global
batch's longest sample, so all ranks run identically shaped steps (ZeRO-3 needs every rank to call the
same modules the same number of times) and 1-process and N-process runs see the same global batches.
The resumable cursor is (epoch, global batch index within the epoch): valid at any world size.

Length bucketing: the epoch's permutation is cut into pools of `bucket_pool` batches, each pool is
sorted by length and cut into batches, and the batch order is shuffled, so a batch holds samples of
similar length (little padding) while the epoch stays random. Incomplete batches are dropped
(train and eval alike), so the data seen never depends on the world size.

Samples longer than data.max_len: `truncate` (the default, unchanged behaviour) keeps the first max_len
tokens; `split` cuts them into overlapping windows (`windows`), each window an item of its own for the
sampler, so a 100K-token sample trains all its targets instead of the first 40K.

Where the samples come from is a *sample source* asked by index: the prep's ShardSet (data.source=offline), or
train/online.py's, which run the frozen target on the prep's rendered samples (online, hybrid); the sampler,
cursor, windows and collate are the same for all.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, fields, is_dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from data_prep.shards import MANIFEST, ShardError, ShardSet, finished_prep
from infra.config_keys import ConfigError
from infra.preemption import ignore_stop_signals
from train.batch import PAD_ID, Batch, collate
from train.config import DataConfig


@dataclass
class Cursor:
    """Where the next micro-batch comes from: global batch `batch` of epoch `epoch`."""

    epoch: int = 0
    batch: int = 0

    def samples_seen(self, batches_per_epoch: int, batch_size: int) -> int:
        return (self.epoch * batches_per_epoch + self.batch) * batch_size


def global_batches(
    lengths: list[int], batch_size: int, seed: int, epoch: int, bucket: bool, bucket_pool: int
) -> list[list[int]]:
    """Sample indices of every global batch of `epoch`, in order. Deterministic; world size free."""
    n_batches = len(lengths) // batch_size
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(len(lengths), generator=g)[: n_batches * batch_size].tolist()
    if not bucket:
        return [perm[i : i + batch_size] for i in range(0, len(perm), batch_size)]
    batches: list[list[int]] = []
    pool = bucket_pool * batch_size
    for start in range(0, len(perm), pool):
        chunk = sorted(perm[start : start + pool], key=lambda i: (-lengths[i], i))
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    order = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in order]


def windows(length: int, max_len: int, overlap: int) -> list[int]:
    """Start offsets of the windows a `length`-token sample is split into (data.overflow=split).

    The rule: windows of max_len tokens with stride max_len - overlap, the last one possibly shorter; a
    window is added while the previous one ends before the sample does. In every window but the first,
    the first `overlap` tokens are context only (`window` clears their loss mask): the previous window
    already trained them, with more context. So each token is a loss target in exactly one window, the
    targets of window w being tokens [(w-1)·stride + max_len, w·stride + max_len), and with
    overlap >= K + 1 even each (token, TTT step) pair is: step k predicts token i of a window from the
    window's position i - k - 2 >= 0 (train/ttt.py), which holds for every i >= overlap.

    Why overlap rather than disjoint windows: the drafter's own attention starts afresh at each window
    (the target's taps and teacher keep their full-sample context, they were captured on the whole
    sample). Disjoint windows would train a later window's first tokens with almost no drafter context,
    which inference never shows it, and would lose the first TTT steps of its first K + 1 tokens; the
    overlap costs overlap / max_len extra tokens per extra window (2048 / 40960 = 5% in eagle3_ttt_40k).
    """
    if not 0 <= overlap < max_len:
        raise ValueError(f"overlap must be in [0, max_len={max_len}), got {overlap}")
    starts = [0]
    while starts[-1] + max_len < length:
        starts.append(starts[-1] + max_len - overlap)
    return starts


def window(sample, start: int, max_len: int, overlap: int):
    """Tokens start .. start+max_len-1 of a sample (a dataclass of [T, ...] tensors) as a sample of its own;
    a window after the first (start > 0) has no loss on its first `overlap` tokens (see `windows`)."""
    if not is_dataclass(sample):
        raise TypeError(f"window() needs a dataclass sample, got {type(sample).__name__}")
    n = len(sample.input_ids)

    def cut(x):
        per_token = isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == n
        return x[start : start + max_len] if per_token else x

    out = replace(sample, **{f.name: cut(getattr(sample, f.name)) for f in fields(sample)})
    if start > 0:
        out.loss_mask = out.loss_mask.clone()
        out.loss_mask[:overlap] = False
    if hasattr(out, "sample_id"):
        out.sample_id = f"{out.sample_id}@{start}"
    return out


def held_out_split(prep: Path) -> Path | None:
    """The held-out split of a finished prep; None where the prep was made without one (eval_samples=0).
    A prep that was asked for held-out samples and lacks them is an error, never a run without evaluation."""
    summary = finished_prep(prep)
    if summary.get("shards") is False:
        raise ShardError(f"{prep}: prepared with stage=render, so it has no shards to read: train it with "
                         "data.source=online or data.source=hybrid")
    asked = summary.get("eval_samples_requested")  # None: a prep from before the key (asked)
    root = Path(prep) / "eval"
    if asked == 0:
        return None
    if not (root / MANIFEST).exists():
        raise ShardError(f"{root / MANIFEST}: missing, but the prep was asked for {asked or 'some'} held-out "
                         "samples; restore the prep's eval/ or rerun the prep")
    if not ShardSet(root, verify="none").lengths():
        raise ShardError(f"{root}: no held-out sample, but the prep was asked for {asked or 'some'} (every "
                         "held-out conversation was dropped: see the prep's summary.json)")
    return root


def check_loss_tokens(data: DataConfig) -> None:
    """ConfigError for data.loss_tokens=all on a prep whose train shards a one-pass capture wrote (capture.one_pass:
    summary.json's capture_pass counts its train samples `with_regeneration`, data_prep/vllm_capture.py). Such a
    sample's rows from its regeneration request's last generated token on are zeros (one_pass_features): no
    objective reads them under the prep's mask, which ends before them, but `all` makes them loss rows, teaching the
    drafter the target's next token from features that are not there. Only data.source=offline reads those shards
    (online and vllm compute whole features; hybrid writes its own); a prep that is not finished is named as such
    where its shards are opened (held_out_split)."""
    if data.loss_tokens != "all" or data.source != "offline":
        return
    try:
        summary = finished_prep(data.dir)
    except ShardError:
        return
    one_pass = ((summary.get("capture_pass") or {}).get("train") or {}).get("with_regeneration") or 0
    if one_pass:
        raise ConfigError(f"data.loss_tokens=all on {data.dir}: {one_pass} of its train samples were captured with "
                          "their regeneration (capture.one_pass; summary.json capture_pass), so their rows past the "
                          "loss mask hold zeros, not the target's features, and data.loss_tokens=all would train on "
                          "them: use data.loss_tokens=assistant, data.source=online (the features computed whole in "
                          "training) or a prep made with capture.one_pass=false")


def rank_part(batch: list[int], rank: int, world_size: int) -> list[int]:
    return batch[rank::world_size]


def pad_to(batch: Batch, length: int) -> Batch:
    """Right-pad every [B, T, ...] tensor of `batch` to T = length (padding is never valid)."""
    extra = length - batch.input_ids.shape[1]
    if extra <= 0:
        return batch
    pads = {"input_ids": PAD_ID}

    def pad(name: str, x):
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return x
        shape = (x.shape[0], extra, *x.shape[2:])
        return torch.cat([x, x.new_full(shape, pads.get(name, 0))], dim=1)

    return replace(batch, **{f.name: pad(f.name, getattr(batch, f.name)) for f in fields(batch)})


class _Indexed(Dataset):
    """Items are (item index, padded length, blank) triples, so collate knows the global batch's length. An item is
    a (sample index, window start) pair: window start 0 = the sample from its beginning (truncated by
    collate in `truncate` mode), else a later window of a split sample. `source` is a sample source: the prep's
    ShardSet, or one that computes its samples (train/online.py), asked for a micro-batch's samples at once."""

    def __init__(self, source: Any, items: list[tuple[int, int]], max_len: int, overlap: int, all_tokens: bool):
        self.source, self.items, self.max_len, self.overlap = source, items, max_len, overlap
        self.all_tokens = all_tokens

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, item: tuple[int, int, bool]):
        return self.__getitems__([item])[0]

    def __getitems__(self, items: list[tuple[int, int, bool]]):
        wanted = [self.items[index] for index, _, _ in items]
        get_many = getattr(self.source, "get_many", None)
        if get_many is None:
            samples = [self.source[sample] for sample, _ in wanted]
        else:  # a rank owns a sample through its first window; a blank row is nobody's (hybrid writes owned ones)
            samples = get_many([sample for sample, _ in wanted],
                               owned=[start == 0 and not blank for (_, start), (_, _, blank) in zip(wanted, items)])
        out = []
        for s, (_, start), (_, length, blank) in zip(samples, wanted, items):
            if self.all_tokens:  # before windowing, which clears the overlap's rows of a later window
                s = replace(s, loss_mask=torch.ones_like(s.loss_mask))
            s = window(s, start, self.max_len, self.overlap) if start else s
            out.append(((_blank(s) if blank else s), length))
        return out


def _blank(sample):
    """`sample` cut to no token: a batch row that is all padding (never valid, never a target)."""
    return replace(sample, **{f.name: getattr(sample, f.name)[:0] for f in fields(sample)
                              if isinstance(getattr(sample, f.name), torch.Tensor)})


def _collate(items, max_len: int) -> Batch:
    samples = [s for s, _ in items]
    return pad_to(collate(samples, max_len=max_len), items[0][1])


def nested_subset(sample_ids: list[str], n: int, where: Path | str = "the split") -> list[int]:
    """Indices of the n samples whose ids hash lowest (sha256), in shard order: a subset independent of
    the shard layout (prep sorts samples by length) and of any seed, and nested in n."""
    if n > len(sample_ids):
        raise ValueError(f"data.train_samples={n} but {where} has {len(sample_ids)} samples")
    rank = sorted(range(len(sample_ids)), key=lambda i: hashlib.sha256(sample_ids[i].encode()).hexdigest())
    return sorted(rank[:n])


class ShardBatches:
    """One split (train or eval) of a prep dir, as this rank's part of each global batch."""

    def __init__(
        self,
        root: Path | Any,
        cfg: DataConfig,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        max_samples: int | None = None,
        subset: int | None = None,
        drop_last: bool = True,
        all_tokens: bool = False,
    ):
        """max_samples: only the first samples of the split (a fixed held-out subset); subset: a fixed,
        nested subset of that many samples (`nested_subset`, data.train_samples). drop_last: an epoch is whole
        batches only (training); False (held-out evaluation): the samples left over make a smaller last batch.
        all_tokens: every real token is a loss target, not only the prep's mask (data.loss_tokens=all)."""
        # a shard set's root, or a sample source (train/online.py: data.source=online|hybrid)
        self.shards = ShardSet(root, verify=cfg.verify) if isinstance(root, (str, Path)) else root
        self.cfg, self.batch_size, self.rank, self.world_size, self.seed = (
            cfg,
            batch_size,
            rank,
            world_size,
            seed,
        )
        self.drop_last, self.all_tokens = drop_last, all_tokens
        lengths = self.shards.lengths()
        chosen = range(len(lengths))[:max_samples]
        if subset is not None:
            chosen = nested_subset(self.shards.sample_ids(), subset, root)
        if cfg.overflow == "split":
            self.items = [(i, s) for i in chosen for s in windows(lengths[i], cfg.max_len, cfg.split_overlap)]
        else:
            self.items = [(i, 0) for i in chosen]
        self.lengths = [min(lengths[i] - s, cfg.max_len) for i, s in self.items]  # per item
        if batch_size % world_size:
            raise ValueError(f"batch size {batch_size} is not a multiple of the world size {world_size}")
        if len(self.lengths) < (batch_size if drop_last else 1):
            raise ValueError(f"{root}: {len(self.lengths)} samples, fewer than one batch of {batch_size}")

    @property
    def manifest(self):
        return self.shards.manifest

    @property
    def batches_per_epoch(self) -> int:
        return (len(self.lengths) if self.drop_last else len(self.lengths) + self.batch_size - 1) // self.batch_size

    def epoch(self, epoch: int, start: int = 0, shuffle: bool = True) -> Iterator[Batch]:
        """This rank's part of global batches start.. of `epoch` (shuffle=False: eval order, by length)."""
        if shuffle:
            if not self.drop_last:
                raise ValueError("shuffled epochs are whole batches only (drop_last=True)")
            order = global_batches(
                self.lengths, self.batch_size, self.seed, epoch, self.cfg.bucket, self.cfg.bucket_pool
            )
        else:
            by_len = sorted(range(len(self.lengths)), key=lambda i: (-self.lengths[i], i))
            by_len = by_len[: self.batches_per_epoch * self.batch_size]
            order = [by_len[i : i + self.batch_size] for i in range(0, len(by_len), self.batch_size)]
        # A smaller last batch may leave a rank nothing: it still runs the step (ZeRO-3 gathers parameters in
        # every rank's forward), on a blank row.
        plan = [
            [(i, max(self.lengths[j] for j in batch), False) for i in rank_part(batch, self.rank, self.world_size)]
            or [(batch[0], max(self.lengths[j] for j in batch), True)]
            for batch in order[start:]
        ]
        source = self.shards
        if hasattr(source, "for_epoch"):  # hybrid: the shard set once epoch 0 has written it (collective)
            source = source.for_epoch(epoch, sorted({i for i, _ in self.items}))
        if hasattr(source, "plan"):  # a source that asks servers (data.source=vllm) sends its requests ahead
            source.plan([[self.items[i][0] for i, _, _ in rows] for rows in plan])
        loader = DataLoader(
            _Indexed(source, self.items, self.cfg.max_len, self.cfg.split_overlap, self.all_tokens),
            batch_sampler=plan,
            collate_fn=partial(_collate, max_len=self.cfg.max_len),
            num_workers=self.cfg.num_workers,
            worker_init_fn=ignore_stop_signals if self.cfg.num_workers else None,  # preemption: the trainer stops
        )
        yield from loader

    def close(self) -> None:
        """End of the run: a source that writes (hybrid) writes what it holds."""
        close = getattr(self.shards, "close", None)
        if close is not None:
            close()

    def stats(self) -> dict:
        """What the source did: the target's forward time and bytes written online (train/online.py)."""
        stats = getattr(self.shards, "stats", None)
        return stats() if stats is not None else {"source": "offline", "bytes_written": 0}
