"""Export round trip; exported keys/shapes as the engines' loaders consume them; public layouts; TargetHead;
the models/ import rule."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from models.eagle3 import Eagle3Config, Eagle3Drafter, export_keys, load_export, save_export
from models.registry import family_of_export
from models.target_head import EMBED_KEY, TargetHead

torch.set_num_threads(1)

TARGET = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
          "num_hidden_layers": 10, "vocab_size": 97, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "max_position_embeddings": 128}


def make_drafter(draft_vocab_size=40, seed=0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    d = Eagle3Drafter(Eagle3Config.from_target_config(TARGET, draft_vocab_size=draft_vocab_size))
    d.load_target_embedding(torch.randn(97, 32))
    targets = torch.sort(torch.randperm(97)[:draft_vocab_size]).values
    t2d = torch.zeros(97, dtype=torch.bool)
    t2d[targets] = True
    d.set_vocab_mapping(targets - torch.arange(draft_vocab_size), t2d)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return d


def logits_of(d: Eagle3Drafter, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    taps, ids = torch.randn(2, 7, 96, generator=g), torch.randint(0, 97, (2, 7), generator=g)
    with torch.no_grad():
        return d.compute_logits(d.forward_step(d.fuse(taps), ids, torch.arange(7)))


def test_round_trip_fp32_is_exact(tmp_path):
    d = make_drafter()
    save_export(d, tmp_path, dtype=torch.float32)
    back = load_export(tmp_path, target_weights={EMBED_KEY: d.embed_tokens.weight})
    assert torch.equal(logits_of(back), logits_of(d))
    assert torch.equal(back.d2t, d.d2t) and torch.equal(back.t2d, d.t2d)
    assert back.cfg == dataclasses.replace(d.cfg, torch_dtype="float32")


def test_round_trip_bf16(tmp_path):
    d = make_drafter()
    save_export(d, tmp_path)  # default bf16
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    rounded = make_drafter()
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.bfloat16().float())
    back = load_export(tmp_path, target_weights={EMBED_KEY: rounded.embed_tokens.weight})
    assert torch.equal(logits_of(back), logits_of(rounded))


# Expectations of the engines' loaders, written as data.
# vLLM 0.32, vllm/model_executor/models/llama_eagle3.py: Eagle3LlamaForCausalLM.load_weights skips "t2d", renames
# "d2t" -> "draft_id_to_target_id", prefixes everything but lm_head with "model."; LlamaModel.load_weights renames
# "midlayer." -> "layers.0." and stacks q/k/v -> qkv_proj, gate/up -> gate_up_proj; a name with no parameter is
# a KeyError. The first layer's qkv_proj takes 2 * hidden_size; fc takes target_hidden_size * 3.
VLLM_STACKED = [(".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
                (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj")]


def vllm_params(c: Eagle3Config) -> dict[str, tuple[int, ...]]:
    H, D, inter = c.hidden_size, c.head_dim, c.intermediate_size
    p = "model.layers.0."
    return {
        "model.fc.weight": (H, c.target_hidden_size * 3),
        p + "self_attn.qkv_proj.weight": ((c.num_attention_heads + 2 * c.num_key_value_heads) * D, 2 * H),
        p + "self_attn.o_proj.weight": (H, c.num_attention_heads * D),
        p + "mlp.gate_up_proj.weight": (2 * inter, H),
        p + "mlp.down_proj.weight": (H, inter),
        p + "input_layernorm.weight": (H,),
        p + "hidden_norm.weight": (H,),
        p + "post_attention_layernorm.weight": (H,),
        "model.norm.weight": (H,),
        "lm_head.weight": (c.draft_vocab_size, H),
        "draft_id_to_target_id": (c.draft_vocab_size,),
        "model.embed_tokens.weight": (c.vocab_size, H),
    }


VLLM_OPTIONAL = {"model.embed_tokens.weight"}  # shared from the target when absent


def vllm_load(tensors: dict[str, torch.Tensor], c: Eagle3Config) -> dict[str, tuple[int, ...]]:
    params, loaded = vllm_params(c), {}
    for name, t in tensors.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        name = name.replace("midlayer.", "layers.0.")
        for param, shard in VLLM_STACKED:
            if shard in name:
                name = name.replace(shard, param)
                rows = loaded.get(name, (0, t.shape[1]))[0] + t.shape[0]
                assert loaded.get(name, (0, t.shape[1]))[1] == t.shape[1], name
                loaded[name] = (rows, t.shape[1])
                break
        else:
            loaded[name] = tuple(t.shape)
        if name not in params:
            raise KeyError(f"vLLM has no parameter {name}")
    return loaded


# SGLang, python/sglang/srt/models/llama_eagle3.py: LlamaForCausalLMEagle3.load_weights turns d2t into
# hot_token_id (d2t + arange), skips t2d, stacks q/k/v and gate/up like vLLM, and looks a name up as-is or under
# "model."; its parameters keep the "midlayer" name (model.midlayer.*), and a name matching no parameter is
# SILENTLY skipped - so layers.0.* keys would be dropped there without an error.
def sglang_params(c: Eagle3Config) -> set[str]:
    layer = {n.replace("model.layers.0.", "model.midlayer.") for n in vllm_params(c) if "layers.0." in n}
    return layer | {"model.fc.weight", "model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"}


def sglang_consumed(tensors: dict[str, torch.Tensor], c: Eagle3Config) -> tuple[set[str], list[str]]:
    params, hit, dropped = sglang_params(c), set(), []
    for name in tensors:
        if "d2t" in name or "t2d" in name:
            continue
        for param, shard in VLLM_STACKED:
            if shard in name:
                name = name.replace(shard, param)
                break
        full = name if name in params else f"model.{name}"
        (hit.add(full) if full in params else dropped.append(name))
    return hit, dropped


def test_export_matches_engine_loaders(tmp_path):
    d = make_drafter()
    save_export(d, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(tensors) == sorted(export_keys())
    cfg_json = json.loads((tmp_path / "config.json").read_text())
    c = Eagle3Config.from_hf_dict(cfg_json)
    # config.json fields the engines read
    assert cfg_json["architectures"] == ["LlamaForCausalLMEagle3"] and cfg_json["model_type"] == "llama"
    assert cfg_json["num_hidden_layers"] == 1 and cfg_json["tie_word_embeddings"] is False
    assert cfg_json["draft_vocab_size"] == 40 and cfg_json["vocab_size"] == 97
    assert cfg_json["target_hidden_size"] == 32 and cfg_json["max_position_embeddings"] == 128
    assert cfg_json["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 5, 7]  # (2, L//2, L-3), L=10
    assert LlamaConfig.from_dict(cfg_json).head_dim == 8
    # vLLM: every key lands on a parameter with the right (stacked) shape; all required ones are covered
    loaded = vllm_load(tensors, c)
    expected = vllm_params(c)
    assert {k: expected[k] for k in loaded} == loaded
    assert set(expected) - set(loaded) == VLLM_OPTIONAL
    # d2t is required by vLLM whenever draft_vocab_size != vocab_size
    assert "draft_id_to_target_id" in loaded and c.draft_vocab_size != c.vocab_size
    # SGLang: nothing silently dropped, everything but the shared embedding covered
    hit, dropped = sglang_consumed(tensors, c)
    assert dropped == [] and sglang_params(c) - hit == {"model.embed_tokens.weight"}
    # the engines' layer-renamed variant is NOT what we export (SGLang would drop it)
    _, dropped = sglang_consumed({k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}, c)
    assert len(dropped) == 10 and all(n.startswith("layers.0.") for n in dropped)


def test_public_layout_loads(tmp_path):
    """layers.0.* keys, an embedded embed_tokens, no t2d, pytorch_model.bin, no eagle_config."""
    d = make_drafter()
    save_export(d, tmp_path / "ours", dtype=torch.float32)
    tensors = load_file(str(tmp_path / "ours" / "model.safetensors"))
    public = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items() if k != "t2d"}
    public["embed_tokens.weight"] = d.embed_tokens.weight.detach().clone()
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    del cfg["eagle_config"]
    (tmp_path / "pub").mkdir()
    torch.save(public, tmp_path / "pub" / "pytorch_model.bin")
    (tmp_path / "pub" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="target_num_layers"):
        load_export(tmp_path / "pub")
    back = load_export(tmp_path / "pub", target_num_layers=10)
    assert back.cfg.tap_layers == d.cfg.tap_layers == [1, 4, 6]
    assert torch.equal(back.t2d, d.t2d)  # derived from d2t
    assert torch.equal(logits_of(back), logits_of(d))


def test_load_errors(tmp_path):
    d = make_drafter()
    save_export(d, tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    save_file({**tensors, "midlayer.self_attn.rotary_emb.inv_freq": torch.ones(4)}, str(path))
    with pytest.raises(ValueError, match="unknown keys \\['midlayer.self_attn.rotary_emb.inv_freq'\\]"):
        load_export(tmp_path)
    save_file({k: v for k, v in tensors.items() if k != "d2t"}, str(path))
    with pytest.raises(ValueError, match="no d2t"):
        load_export(tmp_path)
    save_file({**tensors, "fc.weight": tensors["fc.weight"][:, :64].contiguous()}, str(path))
    with pytest.raises(ValueError, match="fc.weight: checkpoint shape"):
        load_export(tmp_path)
    save_file({k: v for k, v in tensors.items() if k != "norm.weight"}, str(path))
    with pytest.raises(ValueError, match="missing keys \\['norm.weight'\\]"):
        load_export(tmp_path)


def test_full_vocab_drafter_without_d2t_loads_as_identity(tmp_path):
    d = make_drafter(draft_vocab_size=97)
    save_export(d, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}, str(tmp_path / "model.safetensors"))
    with pytest.warns(UserWarning, match="embed_tokens stays random"):
        back = load_export(tmp_path)
    assert torch.equal(back.draft_to_target(torch.arange(97)), torch.arange(97)) and bool(back.t2d.all())
    assert family_of_export({"architectures": ["LlamaForCausalLMEagle3"]}).drafter_cls is Eagle3Drafter


# ------------------------------------------------------------------------------------------ target head
@pytest.mark.parametrize("tied", [False, True])
def test_target_head_matches_transformers(tmp_path, tied):
    torch.manual_seed(0)
    hf_cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                         num_hidden_layers=2, vocab_size=97, rms_norm_eps=1e-5, tie_word_embeddings=tied)
    model = LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    ids = torch.randint(0, 97, (2, 6))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    # hidden_states[-1] is already normed in transformers; the shard stores the PRE-norm last layer output
    pre_norm = {}
    hook = model.model.norm.register_forward_hook(lambda m, a, o: pre_norm.setdefault("h", a[0]))
    with torch.no_grad():
        model(ids)
    hook.remove()
    head = TargetHead.from_hf_model(model)
    assert head.tied == tied and not any(p.requires_grad for p in head.parameters())
    torch.testing.assert_close(head.logits(pre_norm["h"]), out.logits, atol=1e-5, rtol=1e-5)
    head.save(tmp_path / "target_head.safetensors")
    assert sorted(load_file(str(tmp_path / "target_head.safetensors"))) == sorted(
        ["embed_tokens.weight", "norm.weight", *([] if tied else ["lm_head.weight"])])  # a tied head: stored once
    again = TargetHead.from_file(tmp_path / "target_head.safetensors", hf_cfg.to_dict())
    assert torch.equal(again.logits(pre_norm["h"]), head.logits(pre_norm["h"]))
    assert torch.equal(again.embed_tokens_weight, model.get_input_embeddings().weight)
    half = TargetHead.from_file(tmp_path / "target_head.safetensors", hf_cfg.to_dict(), dtype=torch.bfloat16)
    assert half.lm_head.weight.dtype == torch.bfloat16 and half.tied == tied
    with pytest.raises(ValueError, match="does not match the target config"):
        TargetHead.from_file(tmp_path / "target_head.safetensors", {**hf_cfg.to_dict(), "vocab_size": 98})


# ------------------------------------------------------------------------------------------ family table
def test_the_family_table_names_every_piece_of_each_family():
    """One table (models/registry.py) gives each method its drafter, objective and drafting strategy; the
    train loop's objective and the decoder's strategy come from it and nowhere else."""
    from eval.dflash_drafting import DFlashDrafting
    from eval.drafting import EagleDrafting, make_strategy
    from models.registry import FAMILIES, METHODS, family_of_drafter
    from train.dflash import DFlashObjective
    from train.eagle1 import Eagle1Objective
    from train.eagle3 import Eagle3Objective

    assert METHODS == ("eagle3", "eagle1", "dflash")
    want = {"eagle3": (Eagle3Objective, EagleDrafting), "eagle1": (Eagle1Objective, EagleDrafting),
            "dflash": (DFlashObjective, DFlashDrafting)}
    for method, fam in FAMILIES.items():
        assert (fam.objective_cls, fam.drafting_cls) == want[method]
        assert fam.objective_cls.method == method
    d = make_drafter()
    assert family_of_drafter(d).method == "eagle3"
    from eval.spec_decode import SpecSettings

    assert isinstance(make_strategy(d, SpecSettings()), EagleDrafting)
    with pytest.raises(TypeError, match="not the drafter class"):
        family_of_drafter(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------------------------
# a broken export (non-finite weights) is refused at load, naming the tensor; a foreign one names both targets


@pytest.mark.parametrize(("key", "value", "named"), [
    ("fc.weight", float("nan"), "fc.weight (32, 96) holds 1 NaN (the first at index [3, 5])"),
    ("lm_head.weight", float("inf"), "lm_head.weight (40, 32) holds 32 +Inf (the first at index [7, 0])"),
], ids=["nan-fc", "inf-lm-head-row"])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, key: str, value: float, named: str) -> None:
    from models.export import ExportError

    d = make_drafter()
    save_export(d, tmp_path, dtype=torch.float32)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    if key == "fc.weight":
        tensors[key][3, 5] = value
    else:
        tensors[key][7] = value  # a whole row
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ExportError) as e:
        load_export(tmp_path, target_weights={EMBED_KEY: d.embed_tokens.weight})
    assert named in str(e.value) and str(tmp_path / "model.safetensors") in str(e.value), str(e.value)


def test_check_target_names_both_and_the_tap_layers_range() -> None:
    from models.export import ExportError, check_tap_layers, check_target, target_fingerprint

    mine = target_fingerprint({"id": "org/small", "architecture": "LlamaForCausalLM", "num_layers": 10,
                               "hidden_size": 32, "vocab_size": 97}, "abc", [1, 4, 7])
    check_target(mine, {**mine, "id": "/local/copy/of/small", "tap_layers": None}, "drafter d", "target t")
    other = {**mine, "id": "org/other", "num_layers": 12, "tokenizer_hash": "def"}
    with pytest.raises(ExportError) as e:
        check_target(mine, other, "drafter d", "target t")
    text = str(e.value)
    assert "drafter d was trained for org/small (architecture LlamaForCausalLM, num_layers 10" in text, text
    assert "not for target t: org/other (" in text and "differ in num_layers, tokenizer_hash" in text, text
    check_target(None, other, "drafter d", "target t")  # an export from before: nothing recorded to compare
    with pytest.raises(ExportError, match=r"tap layers \[1, 4, 7\] out of range for target t, a 5-layer target"):
        check_target({**mine, "num_layers": None}, {**mine, "num_layers": 5}, "drafter d", "target t")
    check_tap_layers(mine, [1, 4, 7], "drafter d")
    with pytest.raises(ExportError, match=r"layer ids give tap layers \[2, 4, 7\], but the drafter was trained on"):
        check_tap_layers(mine, [2, 4, 7], "drafter d")


def test_other_target_id_compares_hub_ids_and_leaves_directories_to_the_shape(tmp_path) -> None:
    from models.export import other_target_id

    record = {"id": "meta-llama/Llama-3.1-8B-Instruct", "architecture": "LlamaForCausalLM"}
    assert other_target_id(record, ["meta-llama/llama-3.1-8b-instruct"]) is None  # case aside
    assert other_target_id(record, ["llama-3.1-8b-instruct", "meta-llama/Llama-3.1-8B-Instruct"]) is None  # a preset
    assert other_target_id(record, ["meta-llama/Llama-3.1-8B"]) == "meta-llama/Llama-3.1-8B-Instruct"
    assert other_target_id(record, [str(tmp_path)]) is None  # a local copy: its shape and tokenizer decide
    assert other_target_id({**record, "id": "./models/llama"}, ["meta-llama/Llama-3.1-8B"]) is None
    assert other_target_id({"architecture": "LlamaForCausalLM"}, ["meta-llama/Llama-3.1-8B"]) is None  # no id
    assert other_target_id(None, ["meta-llama/Llama-3.1-8B"]) is None and other_target_id(record, [None]) is None
