"""What prep writes before its capture stage: the rendered samples (token ids + loss masks, no features).

    <prep>/rendered/spec.json                       the ShardSpec a capture of them produces (target, tap layers,
                                                    teacher, dtypes, hashes) and how prep loaded the target
    <prep>/rendered/{split}.r{rank}.safetensors     offsets int64 [n+1], input_ids int32 [N], loss_mask bool [N]
    <prep>/rendered/{split}.r{rank}.json            sample ids, lengths and the sha256 of that file

Each rank writes its samples in the order its capture writes them into shards (by length, stably), so a prep's
shard set and its rendered set list the same samples in the same order: offline and online training then draw
the same global batches. Files are written to a temp name and renamed, the index after its data file. They cost
5 bytes per token; training with data.source=online|hybrid reads them (train/online.py), and so does the draft
vocabulary's count.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from data_prep.shards import ShardError, ShardSpec, sha256_file, spec_fields, writing
from infra.files import save_safetensors
from infra.strict_json import dumps

RENDERED_DIR = "rendered"
SPEC_FILE = "spec.json"


@dataclass
class Rendered:
    conversation_id: str
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]


@dataclass
class TargetSource:
    """How prep loaded the target (what online training loads unless data.target names another copy)."""

    model: str  # preset name | hub id | local directory (absolute)
    dtype: str
    chat_template: str | None = None


def capture_order(samples: list[Rendered]) -> list[Rendered]:
    """The order in which prep's capture writes a rank's samples into shards (data_prep/pipeline.py length_batches)."""
    return sorted(samples, key=lambda s: len(s.input_ids))


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: ranks may write the same spec file
    with writing(tmp):
        write(tmp)
    os.replace(tmp, path)


def write_spec(prep_dir: Path, spec: ShardSpec, target: TargetSource) -> None:
    root = Path(prep_dir) / RENDERED_DIR
    root.mkdir(parents=True, exist_ok=True)
    text = dumps({"spec": asdict(spec), "target_source": asdict(target)}, indent=1)
    _atomic(root / SPEC_FILE, lambda p: p.write_text(text))


def write_split(prep_dir: Path, split: str, rank: int, world: int, samples: list[Rendered]) -> None:
    """This rank's rendered samples of `split`, in the given order (`capture_order`). Rank 0 also removes the files
    of ranks a rerun with fewer processes no longer has (their samples are now other ranks')."""
    root = Path(prep_dir) / RENDERED_DIR
    root.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        for index in root.glob(f"{split}.r*.json"):
            if int(index.stem.rsplit(".r", 1)[1]) >= world:
                index.unlink()
                (root / f"{index.stem}.safetensors").unlink(missing_ok=True)
    data, index = root / f"{split}.r{rank}.safetensors", root / f"{split}.r{rank}.json"
    lengths = [len(s.input_ids) for s in samples]
    tensors = {
        "offsets": torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0),
        "input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int32) if samples
        else torch.zeros(0, dtype=torch.int32),
        "loss_mask": torch.cat([s.loss_mask for s in samples]).to(torch.bool) if samples
        else torch.zeros(0, dtype=torch.bool),
    }
    _atomic(data, lambda p: save_safetensors(tensors, p))
    info = {"file": data.name, "rank": rank, "sample_ids": [s.conversation_id for s in samples],
            "lengths": lengths, "sha256": sha256_file(data)}
    _atomic(index, lambda p: p.write_text(dumps(info)))


def has_rendered(prep_dir: Path, split: str) -> bool:
    return any((Path(prep_dir) / RENDERED_DIR).glob(f"{split}.r*.json"))


class RenderedSet:
    """One split's rendered samples, every rank's file in rank order; each file's sha256 is checked on open, so
    a missing, torn or modified file is an error naming it before anything trains."""

    def __init__(self, prep_dir: str | Path, split: str):
        self.root = Path(prep_dir) / RENDERED_DIR
        spec_path = self.root / SPEC_FILE
        if not spec_path.exists():
            raise ShardError(f"{spec_path}: missing, so {prep_dir} has no rendered samples to run the target on "
                             "(a prep from before data.source=online: rerun the same prep command, which skips "
                             "the finished stages, or train with data.source=offline)")
        try:
            raw = json.loads(spec_path.read_text())
            self.spec = ShardSpec(**spec_fields(raw["spec"]))
            self.target_source = TargetSource(**raw["target_source"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ShardError(f"{spec_path}: unreadable ({e})") from e
        parts = sorted(self.root.glob(f"{split}.r*.json"), key=lambda p: int(p.stem.rsplit(".r", 1)[1]))
        if not parts:
            raise ShardError(f"{self.root}/{split}.r*.json: missing, {prep_dir} has no rendered {split} split")
        self.infos: list[dict] = []
        self._files: list[tuple[object, list[int]]] = []
        for part in parts:
            info = json.loads(part.read_text())
            data = self.root / info["file"]
            if not data.exists():
                raise ShardError(f"{data}: missing (listed by {part.name})")
            if sha256_file(data) != info["sha256"]:
                raise ShardError(f"{data}: checksum mismatch with {part.name} (corrupt or modified file)")
            f = safe_open(str(data), framework="pt")
            self.infos.append(info)
            self._files.append((f, f.get_tensor("offsets").tolist()))
        self._index = [(fi, j) for fi, info in enumerate(self.infos) for j in range(len(info["sample_ids"]))]

    def __len__(self) -> int:
        return len(self._index)

    def lengths(self) -> list[int]:
        return [n for info in self.infos for n in info["lengths"]]

    def sample_ids(self) -> list[str]:
        return [i for info in self.infos for i in info["sample_ids"]]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __getitem__(self, i: int) -> Rendered:
        fi, j = self._index[i]
        f, offsets = self._files[fi]
        a, b = offsets[j], offsets[j + 1]
        return Rendered(self.infos[fi]["sample_ids"][j], f.get_slice("input_ids")[a:b].long(),
                        f.get_slice("loss_mask")[a:b].bool())
