"""Target presets resolve without a network: geometry, chat format and EAGLE-3 tap layers."""

import json
from pathlib import Path

import pytest

from data_prep.targets import default_tap_layers, list_presets, resolve_target

EXPECTED = {  # name: (hub id, layers, hidden, vocab, chat format)
    "smollm2-135m-instruct": ("HuggingFaceTB/SmolLM2-135M-Instruct", 30, 576, 49152, "chatml"),
    "llama-3.1-8b-instruct": ("meta-llama/Llama-3.1-8B-Instruct", 32, 4096, 128256, "llama3"),
    "llama-3.3-70b-instruct": ("meta-llama/Llama-3.3-70B-Instruct", 80, 8192, 128256, "llama3"),
    "qwen3-8b": ("Qwen/Qwen3-8B", 36, 4096, 151936, "chatml-thinking"),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", 48, 2048, 151936, "chatml-thinking"),
    "gpt-oss-20b": ("openai/gpt-oss-20b", 24, 2880, 201088, "harmony"),
    "gpt-oss-120b": ("openai/gpt-oss-120b", 36, 2880, 201088, "harmony"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_presets(name: str) -> None:
    p = resolve_target(name)
    assert (p.hf_id, p.num_layers, p.hidden_size, p.vocab_size, p.chat_format) == EXPECTED[name]
    assert p.tap_layers == default_tap_layers(p.num_layers)  # [1, L//2 - 1, L - 4]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_presets_hold_what_config_json_cannot_give(name: str) -> None:
    """A preset repeats nothing config.json gives beyond the geometry offline use needs, nor a default of its
    own schema (EAGLE-3's taps of that many layers), and that geometry matches the public config.json."""
    import dataclasses

    import yaml

    from data_prep.targets import GEOMETRY, TargetPreset, check_preset
    from train.plan import KNOWN_CONFIGS

    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "conf" / "targets" / f"{name}.yaml").read_text())
    assert "tap_layers" not in raw or raw["tap_layers"] != default_tap_layers(raw["num_layers"])
    defaults = {f.name: f.default for f in dataclasses.fields(TargetPreset)}
    assert not [k for k, v in raw.items() if k in defaults and v == defaults[k]], "repeats a default"
    public = KNOWN_CONFIGS[raw["hf_id"]]
    check_preset(resolve_target(name), public, "its public config")
    wrong = {**public, GEOMETRY["num_layers"]: raw["num_layers"] + 1}
    with pytest.raises(ValueError, match=rf"num_layers {raw['num_layers']} \(config.json's num_hidden_layers"):
        check_preset(resolve_target(name), wrong, "its config")


def test_gpt_oss_120b_taps_and_every_preset_listed() -> None:
    assert resolve_target("gpt-oss-120b").tap_layers == [1, 17, 32]
    assert set(EXPECTED) <= set(list_presets())


def test_local_directory_reads_its_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 12, "hidden_size": 64, "vocab_size": 1000, "dtype": "float32"}))
    p = resolve_target(str(tmp_path))
    # the checkpoint's storage dtype is not the compute dtype: auto, resolved per device (infra/precision.py)
    assert (p.num_layers, p.hidden_size, p.vocab_size, p.tap_layers, p.dtype) == (12, 64, 1000, [1, 5, 8], "auto")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_target(str(tmp_path / "empty"))


def _materialise_on_rank(rank: int, cache: str, init_file: str) -> str:
    """One rank of a cold 2-rank prep: torch.distributed is up (it changes what transformers writes)."""
    import os

    import torch.distributed as dist

    os.environ["DRAFTERS_CACHE"] = cache
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        from transformers import AutoModelForCausalLM

        from data_prep.targets import materialise_embedded

        out = materialise_embedded(resolve_target("smollm2-135m-instruct"))
        AutoModelForCausalLM.from_pretrained(out)  # what prep does next, on every rank
        return str(out)
    finally:
        dist.destroy_process_group()


def test_cold_cache_two_ranks_materialise_at_once(tmp_path: Path, smollm2_dir: Path) -> None:
    """A cold `make prep` with 2 ranks reaches the conversion at the same moment. This failed on a fresh machine:
    the ranks shared one temporary directory, and under torch.distributed transformers' save_pretrained writes
    the weights on rank 0 only, so rank 1 could publish a directory without them."""
    import multiprocessing as mp

    from safetensors.torch import load_file

    cache = tmp_path / "cache"
    (cache / "smollm2-135m-instruct").mkdir(parents=True)  # a half-written copy, as the old code could leave
    with mp.get_context("spawn").Pool(2) as pool:
        dirs = pool.starmap(_materialise_on_rank, [(r, str(cache), str(tmp_path / "pg")) for r in range(2)])
    assert dirs == [str(cache / "smollm2-135m-instruct")] * 2
    assert sorted(p.name for p in cache.iterdir()) == [".smollm2-135m-instruct.lock", "smollm2-135m-instruct"]
    got, ref = load_file(Path(dirs[0]) / "model.safetensors"), load_file(smollm2_dir / "model.safetensors")
    assert got.keys() == ref.keys() and all(got[k].equal(ref[k]) for k in ref)
    assert json.loads((Path(dirs[0]) / "config.json").read_text())["model_type"] == "llama"
