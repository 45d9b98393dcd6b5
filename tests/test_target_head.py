"""The stored target head (models/target_head.py): family-aware by construction, versioned, and a format-1 file
(every prep before it) still computes exactly what it always computed."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from models.layers import RMSNorm
from models.target_head import FORMAT, HeadSpec, TargetHead, scaled_embedding_weight

GEOMETRY = {"vocab_size": 97, "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12}


def _random(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.2)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def llama():
    return _random(LlamaForCausalLM(LlamaConfig(**GEOMETRY, tie_word_embeddings=False)))


@pytest.fixture(scope="module")
def gemma3():
    return _random(Gemma3ForCausalLM(Gemma3TextConfig(**GEOMETRY, final_logit_softcapping=20.0)))


def _pre_norm(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grabbed = {}
    hook = model.model.norm.register_forward_pre_hook(lambda _m, args: grabbed.update(h=args[0]))
    try:
        logits = model(ids).logits
    finally:
        hook.remove()
    return grabbed["h"], logits


def test_a_format_1_file_is_the_llama_head_it_always_was(tmp_path, llama) -> None:
    """No metadata: the project's own Llama RMSNorm, no capping, no scale; byte-identical logits."""
    path = tmp_path / "target_head.safetensors"
    save_file({"embed_tokens.weight": llama.model.embed_tokens.weight.contiguous(),
               "norm.weight": llama.model.norm.weight.contiguous(), "lm_head.weight": llama.lm_head.weight.contiguous()},
              str(path))
    head = TargetHead.from_file(path, llama.config.to_dict())
    assert head.spec == HeadSpec() and type(head.norm) is RMSNorm
    h, logits = _pre_norm(llama, torch.arange(20)[None] % 97)
    old = RMSNorm(48, llama.config.rms_norm_eps)
    with torch.no_grad():
        old.weight.copy_(llama.model.norm.weight)
    assert torch.equal(head.logits(h), llama.lm_head(old(h))) and torch.equal(head.logits(h), logits)
    assert torch.equal(head.embed_tokens_weight, llama.model.embed_tokens.weight)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_format_2_round_trip_reproduces_the_target(tmp_path, request, family: str, dtype: torch.dtype) -> None:
    model = copy.deepcopy(request.getfixturevalue(family)).to(dtype)
    head = TargetHead.from_hf_model(model)
    assert head.spec.norm_class == f"{type(model.model.norm).__module__}:{type(model.model.norm).__qualname__}"
    path = tmp_path / "head.safetensors"
    head.save(path, dtype=torch.float32)  # as prep stores it
    again = TargetHead.from_file(path, model.config.to_dict()).to(dtype)
    assert again.spec == head.spec and type(again.norm) is type(model.model.norm) and again.tied == head.tied
    ids = torch.arange(30)[None] % 97
    h, logits = _pre_norm(model, ids)
    assert torch.equal(again.logits(h), logits)
    assert torch.equal(again.embed(ids), model.model.embed_tokens(ids))  # Gemma: times sqrt(48), rounded to dtype
    # what drafters embed with, in the target's dtype, whatever dtype the head is held in
    assert torch.equal(TargetHead.from_file(path, model.config.to_dict()).embed_tokens_weight,
                       scaled_embedding_weight(model))


def test_gemma_specifics_are_recorded(gemma3) -> None:
    spec = TargetHead.from_hf_model(gemma3).spec
    sqrt48 = torch.tensor(48 ** 0.5).item()  # as the fp32 target holds it
    assert (spec.family, spec.final_logit_softcapping, spec.embed_scale) == ("gemma3_text", 20.0, sqrt48)
    assert spec.norm_class.endswith(":Gemma3RMSNorm") and spec.norm_eps == gemma3.config.rms_norm_eps
    assert HeadSpec.from_metadata(spec.to_metadata()) == spec and spec.to_metadata()["format"] == str(FORMAT)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_norm_weight_equivalent_is_the_llama_style_weight(request, family: str) -> None:
    """norm_init=target gives the EAGLE-3 drafter's x·w norm the target's multiplier: w for Llama, 1 + w for Gemma."""
    model = request.getfixturevalue(family)
    w = model.model.norm.weight
    got = TargetHead.from_hf_model(model).norm_weight_equivalent()
    assert torch.equal(got, w if family == "llama" else 1.0 + w)


def test_a_file_cannot_name_any_class_or_a_newer_format() -> None:
    with pytest.raises(ValueError, match="outside"):
        HeadSpec(norm_class="os:system").build_norm(8, 1e-6)
    with pytest.raises(ValueError, match="not importable"):
        HeadSpec(family="x", norm_class="transformers.models.llama.modeling_llama:NoSuchNorm").build_norm(8, 1e-6)
    with pytest.raises(ValueError, match="newer than this code"):
        HeadSpec.from_metadata({"format": str(FORMAT + 1)})


@pytest.mark.integration
def test_a_tied_head_is_stored_once_and_the_same_head_gives_the_same_bytes(tmp_path, gemma3) -> None:
    """Gemma ties its LM head to the embedding: one [V, H] table on disk, loaded back tied; the header is written
    in one key order, so two saves (two processes, as two identical preps) have one sha256."""
    import hashlib
    import json
    import subprocess
    import sys
    from pathlib import Path

    from safetensors import safe_open

    head = TargetHead.from_hf_model(gemma3)
    assert head.tied
    path = tmp_path / "head.safetensors"
    head.save(path, dtype=torch.float32)
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == ["embed_tokens.weight", "norm.weight"] and f.metadata()["tied_lm_head"] == "true"
    assert path.stat().st_size < 97 * 48 * 4 * 2  # one table, not two
    again = TargetHead.from_file(path, gemma3.config.to_dict())
    assert again.tied and again.lm_head.weight is again.embed_tokens.weight
    h, logits = _pre_norm(gemma3, torch.arange(30)[None] % 97)
    assert torch.equal(again.logits(h), logits)
    # a file from before, with both copies, still loads tied
    old = tmp_path / "old.safetensors"
    save_file({k: v.contiguous().clone() for k, v in head.state_dict().items()}, str(old), metadata=head.spec.to_metadata())
    assert TargetHead.from_file(old, gemma3.config.to_dict()).tied
    # the same head saved by separate processes (safetensors' metadata order is per process): identical bytes
    torch.save(head.state_dict(), tmp_path / "state.pt")
    script = ("import sys, torch; from models.target_head import TargetHead, HeadSpec; "
              "import json; "
              "h = TargetHead(48, 97, 1e-6, tie_word_embeddings=True, spec=HeadSpec(**json.loads(sys.argv[2]))); "
              "h.load_state_dict(torch.load(sys.argv[1] + '/state.pt')); h.save(sys.argv[1] + '/' + sys.argv[3])")
    for name in ("a.safetensors", "b.safetensors", "c.safetensors"):
        subprocess.run([sys.executable, "-c", script, str(tmp_path), json.dumps(head.spec.__dict__), name], check=True,
                       cwd=Path(__file__).resolve().parents[1])
    digests = {hashlib.sha256((tmp_path / n).read_bytes()).hexdigest() for n in ("a.safetensors", "b.safetensors",
                                                                                  "c.safetensors")}
    assert len(digests) == 1
