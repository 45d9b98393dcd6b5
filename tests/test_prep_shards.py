"""The shard format: round trip, fp8 taps, checksums, crash leftovers, merging."""

from pathlib import Path

import pytest
import torch

from data_prep.shards import (
    Sample,
    ShardError,
    ShardSet,
    ShardSpec,
    ShardWriter,
    bytes_per_token,
    completed_sample_ids,
    merge_manifests,
)

H, TAPS = 8, [1, 2, 3]


def make_spec(**kw) -> ShardSpec:
    target = {"id": "tiny", "revision": "r", "num_layers": 6, "hidden_size": H, "vocab_size": 50}
    return ShardSpec(target=target, tap_layers=TAPS, **kw)


def make_sample(i: int, n: int, teacher: str = "hidden") -> Sample:
    g = torch.Generator().manual_seed(i)
    kw = {}
    if teacher == "hidden":
        kw["teacher_hidden"] = torch.randn(n, H, generator=g).bfloat16()
    elif teacher == "topk":
        kw["teacher_topk_ids"] = torch.randint(0, 50, (n, 4), generator=g)
        kw["teacher_topk_logits"] = torch.randn(n, 4, generator=g).bfloat16()
    else:
        kw["teacher_argmax"] = torch.randint(0, 50, (n,), generator=g)
    return Sample(
        sample_id=f"s{i}",
        input_ids=torch.randint(0, 50, (n,), generator=g),
        loss_mask=torch.rand(n, generator=g) > 0.5,
        taps=(torch.randn(n, 3 * H, generator=g) * 10).bfloat16(),
        **kw,
    )


@pytest.mark.parametrize("teacher", ["hidden", "topk", "argmax"])
def test_round_trip_many_samples_per_shard(tmp_path: Path, teacher: str) -> None:
    spec = make_spec(teacher=teacher, teacher_topk=4 if teacher == "topk" else 0)
    samples = [make_sample(i, 5 + i % 7, teacher) for i in range(20)]
    w = ShardWriter(tmp_path, spec, tokens_per_shard=40)
    for s in samples:
        w.add(s)
    w.close()
    m = merge_manifests(tmp_path)
    assert 1 < len(m.shards) < len(samples)  # many samples per shard, several shards
    ds = ShardSet(tmp_path, verify="eager")
    assert len(ds) == 20 and ds.lengths() == [len(s) for s in samples]
    for s in samples:
        got = ds[ds.sample_ids().index(s.sample_id)]
        assert torch.equal(got.input_ids, s.input_ids) and torch.equal(got.loss_mask, s.loss_mask)
        assert torch.equal(got.taps, s.taps)
        for name in ("teacher_hidden", "teacher_topk_ids", "teacher_topk_logits", "teacher_argmax"):
            want, have = getattr(s, name), getattr(got, name)
            assert (want is None) == (have is None)
            if want is not None:
                assert torch.equal(have, want)


def test_fp8_taps_are_close_and_smaller(tmp_path: Path) -> None:
    spec = make_spec(taps_dtype="float8_e4m3fn")
    s = make_sample(0, 64)
    w = ShardWriter(tmp_path, spec)
    w.add(s)
    w.close()
    merge_manifests(tmp_path)
    got = ShardSet(tmp_path)[0].taps.float()
    rel = (got - s.taps.float()).norm() / s.taps.float().norm()
    assert got.dtype == torch.float32 and rel < 0.05
    assert bytes_per_token(spec)["taps"] == 3 * H + 4 * 3  # 1 byte per value + one fp32 scale per tap
    assert bytes_per_token(make_spec())["taps"] == 3 * H * 2


def test_corrupt_shard_is_named(tmp_path: Path) -> None:
    w = ShardWriter(tmp_path, make_spec())
    w.add(make_sample(0, 10))
    w.close()
    m = merge_manifests(tmp_path)
    path = tmp_path / m.shards[0].file
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=str(path.name)):
        ShardSet(tmp_path)[0]
    with pytest.raises(ShardError, match="checksum"):
        ShardSet(tmp_path, verify="eager")


def test_reopen_resumes_and_drops_unrecorded_files(tmp_path: Path) -> None:
    spec = make_spec()
    w = ShardWriter(tmp_path, spec, tokens_per_shard=1)
    w.add(make_sample(0, 4))
    w.add(make_sample(1, 4))
    # A crash after a rename but before the manifest update leaves an unrecorded shard behind.
    (tmp_path / "shards" / "r000-000002.safetensors").write_bytes(b"junk")
    (tmp_path / "shards" / "r000-000003.safetensors.tmp").write_bytes(b"junk")
    assert completed_sample_ids(tmp_path) == {"s0", "s1"}
    w2 = ShardWriter(tmp_path, spec, tokens_per_shard=1)
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [
        "r000-000000.safetensors",
        "r000-000001.safetensors",
    ]
    w2.add(make_sample(2, 4))
    w2.close()
    assert merge_manifests(tmp_path).num_samples == 3
    with pytest.raises(ShardError, match="different settings"):
        ShardWriter(tmp_path, make_spec(teacher="argmax"))


def test_merge_rejects_duplicates(tmp_path: Path) -> None:
    for rank in (0, 1):
        w = ShardWriter(tmp_path, make_spec(), rank=rank)
        w.add(make_sample(0, 3))
        w.close()
    with pytest.raises(ShardError, match="duplicate"):
        merge_manifests(tmp_path)


def test_a_manifest_with_the_earlier_max_length_key_still_reads(tmp_path: Path) -> None:
    """Stored data keeps reading after a key's rename: a manifest's max_length is the spec's max_len."""
    import json

    from data_prep.shards import Manifest

    w = ShardWriter(tmp_path, make_spec(max_len=64), tokens_per_shard=40)
    w.add(make_sample(0, 5))
    w.close()
    merge_manifests(tmp_path)
    path = tmp_path / "manifest.json"
    raw = json.loads(path.read_text())
    raw["max_length"] = raw.pop("max_len")
    path.write_text(json.dumps(raw))
    assert Manifest.from_file(path).max_len == 64
