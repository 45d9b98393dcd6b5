"""The shard format: the one contract between data preparation and training.

A *shard set* is a directory::

    <root>/manifest.json            # written last, once every rank has finished
    <root>/manifest.r{rank}.json     # per-rank partial manifests, updated after each complete shard
    <root>/shards/r{rank}-{idx}.safetensors

Each shard is ONE safetensors file holding MANY samples, concatenated along the token axis
(N = total tokens of the shard, n = samples in it):

    offsets          int64  [n + 1]   sample i spans tokens offsets[i]:offsets[i+1]
    input_ids        int32  [N]
    loss_mask        bool   [N]       True where the token is an assistant token (content + end of turn)
    taps             bf16   [N, n_taps * H]   target hidden states AFTER decoder layers `tap_layers`
                     or float8_e4m3fn [N, n_taps * H] with taps_scale float32 [N, n_taps] (per token, per tap)
    teacher_hidden   bf16   [N, H]    output of the target's last decoder layer, BEFORE its final norm
                                      (teacher = "hidden": exact logits = lm_head(norm(h)))
    teacher_topk_ids int32 [N, k], teacher_topk_logits bf16 [N, k]   (teacher = "topk")
    teacher_argmax   int32  [N]       (teacher = "argmax")

and the sample ids as JSON in the safetensors metadata. The manifest records the format version, the
target (id, revision, layer count, hidden size, vocab size), the tap layer ids, the teacher kind, dtypes,
tokenizer and chat-template hashes, and per shard: file, sample ids, per-sample token counts, token count
and sha256. Readers memory-map shards and slice one sample at a time; nothing loads a whole shard.

Writes are crash-safe: a shard is written to a temp file and renamed, and only then recorded in the
rank's partial manifest (itself replaced atomically). A rerun finds the recorded sample ids with
`completed_sample_ids` and skips them, so an interrupted job resumes losing and duplicating nothing.

A prep directory (data_prep/pipeline.py) holds the train/ and eval/ shard sets and the files beside them;
its summary.json is written last, atomically, after everything else and removed before anything is
rewritten, so a prep dir with a summary is complete and one without it is unfinished (`finished_prep`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from infra.files import save_safetensors
from infra.strict_json import dumps

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PREP_SUMMARY = "summary.json"  # a prep dir's last file: its presence marks the prep finished
TARGET_HEAD_FILE = "target_head.safetensors"  # the target's frozen embedding, final norm, LM head
TARGET_CONFIG_FILE = "target_config.json"  # the target's HF config
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
TEACHERS = ("hidden", "topk", "argmax")
TAP_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn, "float32": torch.float32}


class ShardError(RuntimeError):
    """A shard set on disk is unusable (corrupt file, incompatible manifest, ...)."""


@dataclass
class Sample:
    sample_id: str
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    taps: torch.Tensor  # bf16 [T, n_taps * H]
    teacher_hidden: torch.Tensor | None = None  # bf16 [T, H]
    teacher_topk_ids: torch.Tensor | None = None  # int64 [T, k]
    teacher_topk_logits: torch.Tensor | None = None  # [T, k]
    teacher_argmax: torch.Tensor | None = None  # int64 [T]

    def __len__(self) -> int:
        return int(self.input_ids.numel())


@dataclass
class ShardInfo:
    file: str  # relative to the shard set root
    rank: int
    sample_ids: list[str]
    lengths: list[int]
    num_tokens: int
    sha256: str

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)


# Spec fields a manifest or rendered/spec.json written under an earlier name may carry -> their name.
RENAMED_SPEC_FIELDS = {"max_length": "max_len"}


def spec_fields(raw: dict) -> dict:
    """A stored spec's fields under their current names."""
    return {RENAMED_SPEC_FIELDS.get(k, k): v for k, v in raw.items()}


@dataclass
class ShardSpec:
    """Everything about a shard set except its shards: what a reader needs to interpret them."""

    target: dict  # id, revision, architecture, num_layers, hidden_size, vocab_size
    tap_layers: list[int]
    teacher: str = "hidden"
    teacher_topk: int = 0
    taps_dtype: str = "bfloat16"
    tokenizer_hash: str = ""
    chat_template_hash: str = ""
    max_len: int = 0
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.teacher not in TEACHERS:
            raise ValueError(f"teacher must be one of {TEACHERS}, got {self.teacher!r}")
        if self.taps_dtype not in TAP_DTYPES:
            raise ValueError(f"taps_dtype must be one of {sorted(TAP_DTYPES)}, got {self.taps_dtype!r}")
        if self.teacher == "topk" and self.teacher_topk <= 0:
            raise ValueError("teacher='topk' needs teacher_topk > 0")

    @property
    def hidden_size(self) -> int:
        return int(self.target["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.target["vocab_size"])


@dataclass
class Manifest(ShardSpec):
    shards: list[ShardInfo] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    def to_json(self) -> str:
        return dumps(asdict(self), indent=1)

    @classmethod
    def from_file(cls, path: Path) -> Manifest:
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ShardError(f"{path}: unreadable manifest ({e})") from e
        version = raw.get("format_version")
        if version != FORMAT_VERSION:
            raise ShardError(f"{path}: format_version {version}, this code reads {FORMAT_VERSION}")
        raw["shards"] = [ShardInfo(**s) for s in raw.get("shards", [])]
        return cls(**spec_fields(raw))

    def spec(self) -> ShardSpec:
        fields = {k: v for k, v in asdict(self).items() if k != "shards"}
        return ShardSpec(**fields)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Name `path` in a failed write: a full disk raises ENOSPC from write(), an error that names no file."""
    try:
        yield
    except SafetensorError as e:  # safetensors' own I/O error, the OS error as text
        raise OSError(f"writing {path} failed: {e}") from e
    except OSError as e:
        if e.filename is not None:  # already names its file (e.g. a missing directory)
            raise
        raise OSError(e.errno, f"writing {path} failed: {e.strerror or e}") from e


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with writing(tmp):
        tmp.write_text(text)
    os.replace(tmp, path)


def write_prep_summary(prep_dir: str | Path, summary: dict) -> None:
    """The last step of a prep: its summary, written atomically, marks the prep dir finished."""
    _atomic_write_text(Path(prep_dir) / PREP_SUMMARY, dumps(summary, indent=1))


def finished_prep(prep_dir: str | Path) -> dict:
    """The summary of a finished prep dir; ShardError for a prep dir that is unfinished (or none at all)."""
    path = Path(prep_dir) / PREP_SUMMARY
    if not path.exists() and not (Path(prep_dir) / "train").is_dir():
        raise ShardError(f"{prep_dir}: not a prep directory (no {PREP_SUMMARY}, no train/)")
    if not path.exists():
        raise ShardError(f"{prep_dir}: an unfinished prep (no {PREP_SUMMARY}, which prep writes last, after the "
                         "shards, the draft vocabulary and the target files); rerun the same prep command to finish it")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ShardError(f"{path}: unreadable prep summary ({e})") from e


def quantize_fp8(x: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-tap absmax scaling into float8_e4m3fn. x: [N, n_groups * H]."""
    groups = x.float().view(x.shape[0], n_groups, -1)  # (N, n_taps, H)
    scale = groups.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX  # (N, n_taps)
    q = (groups / scale[..., None]).to(torch.float8_e4m3fn)
    return q.view(x.shape[0], -1), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    groups = q.float().view(q.shape[0], scale.shape[1], -1) * scale[..., None]
    return groups.view(q.shape[0], -1).to(torch.bfloat16)


def bytes_per_token(spec: ShardSpec) -> dict[str, float]:
    """Storage cost of one token under `spec` (payload only, not counting file headers)."""
    n_taps, hidden = len(spec.tap_layers), spec.hidden_size
    taps = n_taps * hidden * (1 if spec.taps_dtype == "float8_e4m3fn" else 2)
    if spec.taps_dtype == "float32":
        taps *= 2
    if spec.taps_dtype == "float8_e4m3fn":
        taps += 4 * n_taps
    teacher = {"hidden": 2 * hidden, "topk": 6 * spec.teacher_topk, "argmax": 4}[spec.teacher]
    ids_mask = 4 + 1
    return {"taps": taps, "teacher": teacher, "ids_mask": ids_mask, "total": taps + teacher + ids_mask}


def stored_fields(spec: ShardSpec) -> tuple[str, ...]:
    """The Sample fields a shard of `spec` stores (its teacher kind's only)."""
    teacher = {"hidden": ("teacher_hidden",), "topk": ("teacher_topk_ids", "teacher_topk_logits"),
               "argmax": ("teacher_argmax",)}[spec.teacher]
    return ("input_ids", "loss_mask", "taps", *teacher)


def to_storage(fields: dict[str, torch.Tensor], spec: ShardSpec) -> dict[str, torch.Tensor]:
    """Per-token tensors (of one sample, or of many joined along the token axis) in a shard's dtypes: what
    ShardWriter writes. Every conversion is per token (fp8 scales too), so a sample stored alone equals its
    slice of a stored shard."""
    out = {"input_ids": fields["input_ids"].to(torch.int32), "loss_mask": fields["loss_mask"].to(torch.bool)}
    if spec.taps_dtype == "float8_e4m3fn":
        out["taps"], out["taps_scale"] = quantize_fp8(fields["taps"], len(spec.tap_layers))
    else:
        out["taps"] = fields["taps"].to(TAP_DTYPES[spec.taps_dtype])
    if spec.teacher == "hidden":
        out["teacher_hidden"] = fields["teacher_hidden"].to(torch.bfloat16)
    elif spec.teacher == "topk":
        out["teacher_topk_ids"] = fields["teacher_topk_ids"].to(torch.int32)
        out["teacher_topk_logits"] = fields["teacher_topk_logits"].to(torch.bfloat16)
    else:
        out["teacher_argmax"] = fields["teacher_argmax"].to(torch.int32)
    return out


def from_storage(sample_id: str, stored: dict[str, torch.Tensor]) -> Sample:
    """A Sample from its stored tensors (a shard's slices, or `to_storage`'s output): what ShardSet returns."""
    taps = stored["taps"]
    if "taps_scale" in stored:
        taps = dequantize_fp8(taps, stored["taps_scale"])
    elif taps.dtype != torch.bfloat16:
        taps = taps.to(torch.bfloat16)
    ids, argmax = stored.get("teacher_topk_ids"), stored.get("teacher_argmax")
    return Sample(
        sample_id=sample_id,
        input_ids=stored["input_ids"].long(),
        loss_mask=stored["loss_mask"].bool(),
        taps=taps,
        teacher_hidden=stored.get("teacher_hidden"),
        teacher_topk_ids=None if ids is None else ids.long(),
        teacher_topk_logits=stored.get("teacher_topk_logits"),
        teacher_argmax=None if argmax is None else argmax.long(),
    )


def as_read_back(sample: Sample, spec: ShardSpec) -> Sample:
    """`sample`, as captured, exactly as a shard set of `spec` returns it once written (storage dtypes, the fp8
    round trip): what online training trains on, so that it sees the very values offline training reads."""
    return from_storage(sample.sample_id, to_storage({n: getattr(sample, n) for n in stored_fields(spec)}, spec))


class ShardWriter:
    """Buffers samples of one rank and writes them as shards of about `tokens_per_shard` tokens."""

    def __init__(self, root: str | Path, spec: ShardSpec, rank: int = 0, tokens_per_shard: int = 1 << 20):
        self.root, self.spec, self.rank = Path(root), spec, rank
        self.tokens_per_shard = tokens_per_shard
        (self.root / "shards").mkdir(parents=True, exist_ok=True)
        self.partial_path = self.root / f"manifest.r{rank}.json"
        self.manifest = self._load_or_start()
        self._buffer: list[Sample] = []
        self._buffered_tokens = 0
        self.bytes_written = sum((self.root / s.file).stat().st_size for s in self.manifest.shards)

    def _load_or_start(self) -> Manifest:
        if self.partial_path.exists():
            manifest = Manifest.from_file(self.partial_path)
            if asdict(manifest.spec()) != asdict(self.spec):
                raise ShardError(
                    f"{self.partial_path}: existing shards were written with different settings; "
                    "use a fresh output directory or the original settings"
                )
        else:
            manifest = Manifest(**asdict(self.spec))
        recorded = {s.file for s in manifest.shards}
        for stale in (self.root / "shards").glob(f"r{self.rank:03d}-*"):
            # Left by a crash between the rename and the manifest update, or a torn temp file.
            if f"shards/{stale.name}" not in recorded:
                stale.unlink()
        return manifest

    def add(self, sample: Sample) -> None:
        self._buffer.append(sample)
        self._buffered_tokens += len(sample)
        if self._buffered_tokens >= self.tokens_per_shard:
            self.flush()

    def flush(self) -> None:
        if not self._buffer:
            return
        samples, self._buffer, self._buffered_tokens = self._buffer, [], 0
        name = f"shards/r{self.rank:03d}-{len(self.manifest.shards):06d}.safetensors"
        path = self.root / name
        tmp = path.with_name(path.name + ".tmp")
        with writing(tmp):
            save_safetensors(self._pack(samples), tmp, metadata={"sample_ids": dumps([s.sample_id for s in samples])})
        os.replace(tmp, path)
        lengths = [len(s) for s in samples]
        self.manifest.shards.append(
            ShardInfo(name, self.rank, [s.sample_id for s in samples], lengths, sum(lengths), sha256_file(path))
        )
        _atomic_write_text(self.partial_path, self.manifest.to_json())
        self.bytes_written += path.stat().st_size

    def _pack(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        lengths = torch.tensor([0] + [len(s) for s in samples], dtype=torch.int64)
        joined = {name: torch.cat([getattr(s, name) for s in samples]) for name in stored_fields(self.spec)}
        out = {"offsets": lengths.cumsum(0), **to_storage(joined, self.spec)}
        return {k: v.contiguous() for k, v in out.items()}

    def close(self) -> Manifest:
        self.flush()
        if not self.partial_path.exists():  # a rank with no work still reports its (empty) part
            _atomic_write_text(self.partial_path, self.manifest.to_json())
        return self.manifest


def completed_sample_ids(root: str | Path) -> set[str]:
    """Sample ids already recorded in any rank's partial manifest (what a resumed run must skip)."""
    done: set[str] = set()
    for path in Path(root).glob("manifest.r*.json"):
        for shard in Manifest.from_file(path).shards:
            done.update(shard.sample_ids)
    return done


def recorded_sample_ids(root: str | Path, rank: int) -> list[str]:
    """The sample ids rank `rank` has recorded in its partial manifest, in the order its shards hold them."""
    path = Path(root) / f"manifest.r{rank}.json"
    if not path.exists():
        return []
    return [i for shard in sorted(Manifest.from_file(path).shards, key=lambda s: s.file) for i in shard.sample_ids]


def merge_manifests(root: str | Path) -> Manifest:
    """Join the per-rank partial manifests into manifest.json (call once, after every rank closed)."""
    root = Path(root)
    parts = sorted(root.glob("manifest.r*.json"))
    if not parts:
        raise ShardError(f"{root}: no partial manifests to merge")
    manifests = [Manifest.from_file(p) for p in parts]
    spec = manifests[0].spec()
    for p, m in zip(parts, manifests):
        if asdict(m.spec()) != asdict(spec):
            raise ShardError(f"{p}: settings differ from {parts[0].name}")
    merged = Manifest(**asdict(spec))
    merged.shards = sorted((s for m in manifests for s in m.shards), key=lambda s: s.file)
    ids = [i for s in merged.shards for i in s.sample_ids]
    if len(ids) != len(set(ids)):
        raise ShardError(f"{root}: duplicate sample ids across shards")
    _atomic_write_text(root / MANIFEST, merged.to_json())
    return merged


class ShardSet:
    """Random access to the samples of a shard set through memory-mapped slices.

    Each shard's sha256 is checked the first time the shard is opened (verify="lazy"), for every
    shard up front (verify="eager"), or never (verify="none"); a mismatch raises ShardError naming the file.
    """

    def __init__(self, root: str | Path, verify: str = "lazy"):
        if verify not in ("lazy", "eager", "none"):
            raise ValueError(f"verify must be lazy|eager|none, got {verify!r}")
        self.root = Path(root)
        path = self.root / MANIFEST
        if not path.exists():
            raise ShardError(f"{path}: no manifest (is this a prepared shard set, and did prep finish?)")
        self.manifest = Manifest.from_file(path)
        self.verify = verify
        self._index = [(si, j) for si, s in enumerate(self.manifest.shards) for j in range(s.num_samples)]
        self._open: dict[int, tuple[object, list[int]]] = {}
        if verify == "eager":
            for si in range(len(self.manifest.shards)):
                self._check(si)

    def __len__(self) -> int:
        return len(self._index)

    def lengths(self) -> list[int]:
        return [n for s in self.manifest.shards for n in s.lengths]

    def sample_ids(self) -> list[str]:
        return [i for s in self.manifest.shards for i in s.sample_ids]

    def _check(self, si: int) -> None:
        info = self.manifest.shards[si]
        path = self.root / info.file
        if not path.exists():
            raise ShardError(f"{path}: shard listed in the manifest is missing")
        if sha256_file(path) != info.sha256:
            raise ShardError(f"{path}: checksum mismatch (corrupt or modified shard)")

    def _handle(self, si: int):
        if si not in self._open:
            if self.verify == "lazy":
                self._check(si)
            f = safe_open(str(self.root / self.manifest.shards[si].file), framework="pt")
            self._open[si] = (f, f.get_tensor("offsets").tolist())
        return self._open[si]

    def __getitem__(self, i: int) -> Sample:
        si, j = self._index[i]
        f, offsets = self._handle(si)
        a, b = offsets[j], offsets[j + 1]
        stored = {name: f.get_slice(name)[a:b] for name in f.keys() if name != "offsets"}
        return from_storage(self.manifest.shards[si].sample_ids[j], stored)

    def __iter__(self) -> Iterable[Sample]:
        return (self[i] for i in range(len(self)))
