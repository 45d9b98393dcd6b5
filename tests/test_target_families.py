"""Every common target family end to end: a tiny random model of each, built from transformers' own
config class with SmolLM2's tokenizer (no hub), is prepared (its fidelity check passing), trained for 2 steps,
exported, and decoded speculatively token for token as plain greedy decoding. The fidelity check is also run in
bf16 and shown to catch mutants: a wrong final norm, a dropped soft-cap, a dropped embedding scale, a shifted tap.

Each target: hidden 48 (sqrt(48) is not a bf16 number, so Gemma's embedding scale rounds), 4 layers, taps
[0, 1, 2], norm weights drawn in [0.5, 1.5] (so x·w and x·(1 + w) differ), sliding windows of 16 tokens where
the family has them (shorter than the samples, so those layers really slide).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_prep

from data_prep.capture import HiddenStateCapture
from data_prep.fidelity import FidelityError, check_fidelity, probe_batch
from models.target_head import HeadSpec, TargetHead, scaled_embedding_weight

ROOT = Path(__file__).resolve().parents[1]
TAPS = [0, 1, 2]
WINDOW = 16
COMMON = {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 12}
SLIDING_FULL = ["sliding_attention", "full_attention"] * 2
FAMILIES: dict[str, tuple[str, dict]] = {  # name: (transformers config class, its arguments beyond COMMON)
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "norm_topk_prob": True}),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW}),  # no layer types: every layer slides
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "gemma2": ("Gemma2Config", {"query_pre_attn_scalar": 12, "sliding_window": WINDOW}),  # soft-capping 30 (default)
    "gemma3_text": ("Gemma3TextConfig", {
        "query_pre_attn_scalar": 12, "sliding_window": WINDOW, "layer_types": SLIDING_FULL,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    "phi3": ("Phi3Config", {"sliding_window": WINDOW}),
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
                                 "intermediate_size": 48}),
}
NO_TEMPLATE = "gemma3_text"  # saved like a base model: no chat template; prep and eval are given one
GEMMA = ("gemma2", "gemma3_text")
MOE = ("qwen3_moe", "mixtral", "gpt_oss")


def build_target(name: str, tok, seed: int = 0):
    import transformers
    from transformers import AutoModelForCausalLM

    class_name, extra = FAMILIES[name]
    config = getattr(transformers, class_name)(
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, **{**COMMON, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname and p.dim() == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    assert model.config.model_type == name
    return model.requires_grad_(False)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory, tokenizer) -> Path:
    path = tmp_path_factory.mktemp("template") / "chatml.jinja"
    path.write_text(tokenizer.chat_template)
    return path


@pytest.fixture(scope="module")
def target_dirs(tmp_path_factory, tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    dirs = {}
    for i, name in enumerate(FAMILIES):
        out = root / name
        build_target(name, tokenizer, seed=i).save_pretrained(out)
        tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
        if name == NO_TEMPLATE:
            tok.chat_template = None
        tok.save_pretrained(out)
        assert (type(tokenizer).from_pretrained(out).chat_template is None) == (name == NO_TEMPLATE)
        dirs[name] = out
    return dirs


def _prep_options(name: str, template_file: Path) -> dict:
    opts = {"num_samples": 4, "eval_samples": 2, "max_len": 96, "regen.max_new_tokens": 8,
            "capture.tap_layers": TAPS}
    return {**opts, "chat_template": str(template_file)} if name == NO_TEMPLATE else opts


@pytest.fixture(scope="module")
def preps(tmp_path_factory, target_dirs, tiny_sharegpt_file: Path, template_file: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family_preps")
    for name, d in target_dirs.items():
        run_prep(root / name, str(d), str(tiny_sharegpt_file), **_prep_options(name, template_file))
    return {name: root / name for name in target_dirs}


TRAIN_ALL = """
import json, sys, traceback
from hydra import compose, initialize_config_dir
from train.config import RunConfig, register_configs
from train.engine import shutdown_distributed
from train.trainer import run
register_configs()
jobs, status = json.loads(sys.argv[2]), {}
with initialize_config_dir(sys.argv[1], version_base="1.3"):
    for name, (prep, out) in jobs.items():
        overrides = ["+exp=debug", f"data.dir={prep}", f"out_dir={out}", "train.max_steps=2", "train.eval_interval=0",
                     "train.save_interval=0", "data.eval_batch_size=4", "data.max_len=96"]
        try:
            run(RunConfig.from_omegaconf(compose("train", overrides=overrides)).validate(1), out)
            status[name] = "ok"
        except Exception:
            status[name] = traceback.format_exc()
shutdown_distributed()
print("STATUS " + json.dumps(status))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, preps) -> dict[str, tuple[Path, str]]:
    """2 training steps on every family's prep, in ONE process (DeepSpeed starts once); the held-out split (2
    samples) is smaller than data.eval_batch_size=4: a smaller last batch."""
    root = tmp_path_factory.mktemp("family_runs")
    jobs = {name: (str(prep), str(root / name)) for name, prep in preps.items()}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="disabled", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", TRAIN_ALL, str(ROOT / "conf"), json.dumps(jobs)], capture_output=True,
                       text=True, env=env, timeout=900, cwd=ROOT)
    lines = [line for line in r.stdout.splitlines() if line.startswith("STATUS ")]
    assert r.returncode == 0 and lines, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    status = json.loads(lines[-1].removeprefix("STATUS "))
    return {name: (root / name, status[name]) for name in preps}


def _last_layer_output(model, ids: torch.Tensor) -> tuple[torch.Tensor, object]:
    grabbed = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _i, o: grabbed.update(h=o[0] if isinstance(o, tuple) else o))
    try:
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
    finally:
        hook.remove()
    return grabbed["h"], out


@pytest.mark.parametrize("name", FAMILIES)
def test_the_head_read_without_the_layers_is_the_loaded_targets(name: str, target_dirs) -> None:
    """capture.engine=vllm reads the head's tensors alone (data_prep.targets.load_target_head): the same tensors,
    tying and family spec (norm class, soft-cap, embedding scale) as the head taken from the loaded target."""
    from data_prep.targets import load_target, load_target_head, resolve_target

    preset = resolve_target(str(target_dirs[name]))
    head, config = load_target_head(preset, "float32")
    model, _ = load_target(preset, "float32", "cpu", chat_template="{{ '' }}")
    ref = TargetHead.from_hf_model(model)
    assert head.spec == ref.spec and head.tied == ref.tied
    assert head.state_dict().keys() == ref.state_dict().keys()
    for key, value in ref.state_dict().items():
        assert torch.equal(head.state_dict()[key], value), key
    assert config.to_dict() == model.config.to_dict()  # what prep writes as target_config.json


@pytest.mark.parametrize("name", FAMILIES)
def test_prep_stores_a_head_that_reproduces_the_target(name: str, preps, target_dirs) -> None:
    """The prep's own check passed (fp32: logits within 1e-4, the same argmax), and the head it stored rebuilds the
    target's logits, embedding and norm from the file alone, as training does."""
    from transformers import AutoModelForCausalLM

    from data_prep.shards import ShardSet
    from train.build import load_head

    prep = preps[name]
    summary = json.loads((prep / "summary.json").read_text())
    fid = summary["fidelity"]
    print(f"{name}: fidelity max abs diff {fid['max_abs_diff']}")
    assert fid["family"] == name and fid["dtype"] == "float32" and fid["argmax_agreement"] == 1.0
    assert fid["max_abs_diff"]["LM head"] <= 1e-4 and set(fid["max_abs_diff"]) >= {f"tap {i}" for i in TAPS}
    spec = HeadSpec(**summary["target_head"])
    assert spec.family == name and spec.norm_class.startswith("transformers.models.")
    assert (spec.final_logit_softcapping == 30.0) == (name == "gemma2")
    sqrt48 = torch.tensor(48 ** 0.5).item()  # as the fp32 target holds it
    assert (spec.embed_scale == sqrt48) == (name in GEMMA) and (spec.embed_scale == 1.0) == (name not in GEMMA)

    model = AutoModelForCausalLM.from_pretrained(target_dirs[name], dtype=torch.float32).eval().requires_grad_(False)
    head = load_head(prep)
    sample = ShardSet(prep / "train")[0]
    ids = sample.input_ids[None].long()
    final, out = _last_layer_output(model, ids)
    assert float((head.logits(final) - out.logits).abs().max()) <= 1e-4
    assert torch.equal(head.logits(final).argmax(-1), out.logits.argmax(-1))
    assert torch.equal(head.embed(ids), out.hidden_states[0])
    assert torch.equal(head.embed_tokens_weight, scaled_embedding_weight(model))
    # the bf16 teacher in the shards: the argmax mostly survives the storage rounding
    stored = head.logits(sample.teacher_hidden.float()[None]).argmax(-1)
    assert (stored == out.logits.argmax(-1)).float().mean() > 0.9
    for j, layer in enumerate(TAPS):  # stored taps = the target's hidden states, up to bf16 storage
        torch.testing.assert_close(sample.taps[:, j * 48:(j + 1) * 48].float(), out.hidden_states[layer + 1][0],
                                   rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name", FAMILIES)
def test_train_export_and_lossless_greedy_decoding(name: str, runs, preps, target_dirs, template_file) -> None:
    from transformers import AutoModelForCausalLM

    from data_prep.targets import load_tokenizer, resolve_target
    from eval.prompts import render
    from eval.run import load_drafter
    from eval.sampling import SamplingParams
    from eval.spec_decode import SpecSettings, SpeculativeDecoder, plain_generate
    from eval.target import TargetRunner

    run, status = runs[name]
    assert status == "ok", status
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["steps"] == 2 and summary["eval"]["num_samples"] == 2
    config = json.loads((run / "export" / "config.json").read_text())
    if name == "gemma3_text":  # the full-attention layers' rotation
        rope = config["rope_parameters"]
        assert (rope["rope_type"], rope["factor"], rope["rope_theta"]) == ("linear", 8.0, 1e6)

    torch.set_num_threads(1)
    # float64, so that no near-tie between two logits decides; the grouped-matmul MoE kernels take no float64
    experts = {"experts_implementation": "eager"} if name in MOE else {}
    model = AutoModelForCausalLM.from_pretrained(target_dirs[name], dtype=torch.float64, **experts).eval()
    drafter = load_drafter(str(run / "export"), model, "cpu", torch.float64)
    assert torch.equal(drafter.embed_tokens.weight, scaled_embedding_weight(model))
    tok = load_tokenizer(resolve_target(str(target_dirs[name])),
                         str(template_file) if name == NO_TEMPLATE else None)
    prompt = render(tok, [{"role": "user", "content": "Name a colour and say why you like it."}])
    runner = TargetRunner(model, drafter.tap_layers)
    plain = plain_generate(runner, prompt, 20, SamplingParams())
    assert len(prompt) + 20 > WINDOW  # past the sliding window
    for settings in (SpecSettings(mode="chain", depth=3), SpecSettings(mode="tree", depth=3, topk=2, total_tokens=6)):
        spec = SpeculativeDecoder(runner, drafter, settings).generate(prompt, 20, SamplingParams())
        assert spec.output_ids == plain.output_ids, settings


def _probe(model, tok, taps=TAPS):
    from data_prep.conversations import Conversation, Message

    convs = [Conversation(f"p{i}", [Message("user", q), Message("assistant", a)], "probe")
             for i, (q, a) in enumerate([("What is 2 + 2?", "It is 4, as two and two make four."),
                                         ("Say hello.", "Hello there!")])]
    return probe_batch(tok, convs, 64, {})


@pytest.mark.parametrize("name", FAMILIES)
def test_fidelity_in_bf16_and_a_wrong_norm_is_caught(name: str, tokenizer) -> None:
    """bf16: the check passes within its documented tolerance (2 bf16 units in the last place); fp32: a head whose
    norm weight is off by 0.05 is refused, naming the family and the pieces."""
    model = build_target(name, tokenizer)
    ids, attn = _probe(model, tokenizer)
    bf16 = model.to(torch.bfloat16)
    with HiddenStateCapture(bf16, TAPS) as capture:
        got = check_fidelity(bf16, TargetHead.from_hf_model(bf16), capture, ids, attn)
    print(f"{name} bf16: {got['max_abs_diff']} (tolerance {got['tolerance']['LM head']:.3g})")
    assert got["dtype"] == "bfloat16" and all(got["max_abs_diff"][k] <= got["tolerance"][k] for k in got["tolerance"])

    model = build_target(name, tokenizer)
    mutant = _mutant(model)  # the family's own norm, its weight off by 0.05
    with torch.no_grad():
        mutant.norm.weight += 0.05
    with HiddenStateCapture(model, TAPS) as capture, pytest.raises(FidelityError) as e:
        check_fidelity(model, mutant, capture, ids, attn)
    text = str(e.value)
    assert f"the {name} target" in text and "final norm: max abs difference" in text and "LM head" in text, text
    assert "tap 0" not in text and "input embedding" not in text


def _mutant(model, **spec_changes) -> TargetHead:
    head = TargetHead.from_hf_model(model)
    text = model.config.get_text_config()
    out = TargetHead(text.hidden_size, text.vocab_size, text.rms_norm_eps, tie_word_embeddings=head.tied,
                     spec=dataclasses.replace(head.spec, **spec_changes))
    out.load_state_dict(head.state_dict())
    return out


@pytest.mark.parametrize("name", GEMMA)
def test_a_llama_style_norm_on_gemma_is_caught(name: str, tokenizer) -> None:
    """The issue's bug: Gemma's final norm rebuilt as x·w instead of x·(1 + w)."""
    model = build_target(name, tokenizer)
    ids, attn = _probe(model, tokenizer)
    with HiddenStateCapture(model, TAPS) as capture, pytest.raises(FidelityError) as e:
        check_fidelity(model, _mutant(model, norm_class=None), capture, ids, attn)
    assert f"the {name} target" in str(e.value) and "final norm: max abs difference" in str(e.value)
    assert "argmax differs" in str(e.value)


def test_a_dropped_soft_cap_and_a_dropped_embedding_scale_are_caught(tokenizer) -> None:
    model = build_target("gemma2", tokenizer)
    ids, attn = _probe(model, tokenizer)
    with HiddenStateCapture(model, TAPS) as capture:
        with pytest.raises(FidelityError, match="LM head: max abs difference") as e:
            check_fidelity(model, _mutant(model, final_logit_softcapping=None), capture, ids, attn)
        assert "final norm" not in str(e.value)
        with pytest.raises(FidelityError, match="input embedding: max abs difference"):
            check_fidelity(model, _mutant(model, embed_scale=1.0), capture, ids, attn)


class _OffByOne(HiddenStateCapture):
    """Records each tap layer's INPUT: the hidden state of the layer before it."""

    def __enter__(self):
        for i in self._wanted:
            self._handles.append(self._layers[i].register_forward_pre_hook(
                lambda _m, args, i=i: self._store.__setitem__(i, args[0])))
        return self


def test_a_shifted_tap_is_caught(tokenizer) -> None:
    model = build_target("llama", tokenizer)
    ids, attn = _probe(model, tokenizer)
    with _OffByOne(model, TAPS) as capture, pytest.raises(FidelityError) as e:
        check_fidelity(model, TargetHead.from_hf_model(model), capture, ids, attn)
    assert all(f"tap {i}: max abs difference" in str(e.value) for i in TAPS) and "teacher" in str(e.value)


def test_a_wrong_norm_stops_the_prep_before_anything_is_generated(tmp_path, monkeypatch, target_dirs,
                                                                  tiny_sharegpt_file, template_file) -> None:
    original = HeadSpec.from_hf_model
    monkeypatch.setattr(HeadSpec, "from_hf_model",
                        classmethod(lambda cls, model: dataclasses.replace(original(model), norm_class=None)))
    out = tmp_path / "prep"
    with pytest.raises(FidelityError, match="the gemma3_text target .*final norm"):
        run_prep(out, str(target_dirs["gemma3_text"]), str(tiny_sharegpt_file),
                 **_prep_options("gemma3_text", template_file))
    assert not (out / "regen").exists() and not (out / "train").exists()
