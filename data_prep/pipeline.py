"""`make prep`: conversations → (regenerated) chat samples → target hidden states → shard sets.

Output directory (the prep contract; the shard format itself is documented in data_prep/shards.py):

    <out>/train/, <out>/eval/        shard sets (manifest.json + shards/); eval is held out, never trained on;
                                     capture_pass.r{rank}.jsonl: the shards a one-pass regeneration wrote
    <out>/draft_vocab.safetensors    d2t, t2d, token_counts (the train split's loss-masked tokens),
                                     dataset_counts, selection_scores (data_prep/vocab.py; each
                                     rank's share of the dataset count: dataset_counts.r{rank}.safetensors)
    <out>/target_head.safetensors    frozen target embed_tokens / norm / lm_head, so training needs no target
                                     (metadata: the family's norm class, soft-capping, embedding scale)
    <out>/target_config.json         the target's HF config
    <out>/tokenizer/                 the target's tokenizer (loss-mask viewer, eval)
    <out>/regen/{split}.r{rank}.jsonl  regenerated conversations with a status per conversation
    <out>/rendered/                  the samples before capture (token ids, loss masks; data_prep/rendered.py):
                                     what data.source=online|hybrid training runs the target on. stage=render
                                     stops after writing them (and the files beside the shards): no shards
    <out>/summary.json               counts, skips by reason, bytes, throughput, how each split's samples were
                                     captured (capture_pass), the stages' wall seconds; written last (atomically)
                                     and removed when a rerun starts rewriting: no summary = an unfinished prep

Before the target's weights load, `preflight` refuses what training would refuse (RoPE layout, geometry, tap
ids) and a tokenizer without a chat template; right after, before any regeneration, data_prep/fidelity.py checks
on a probe batch that the head and taps the prep stores reproduce the target's own computation (with
regen.backend=vllm the transformers target loads after the regeneration, and the check runs then).

The stages follow one plan, computed once from the config (`plan_prep`: which backend regenerates, which engine
captures, whether and when the transformers target loads). Prep's vLLM server (serving/client.py: one per
rank on its own devices, or the user's vllm.urls) starts right after the data is loaded and checked, before the
head loads, when regen.backend=vllm or capture.engine=vllm: the server that regenerates is the one that captures.
The dataset-wide vocabulary count runs beside its startup and stops as soon as it exits; prep then waits for its
health (bounded by vllm.timeout_s) before the probe and the regeneration. With both on the server and
capture.one_pass (the default), the regeneration captures: the probe is judged first, each finished conversation is
rendered and its sample written from the states its final request kept (data_prep/vllm_capture.py OnePassCapture),
and the capture stage prefills only the samples those states do not cover.

Work is split across torchrun ranks by position (sample i goes to rank i % world); each rank writes
its own shards and the last step (rank 0) merges the manifests. With capture.tensor_parallel_size=t the target is
split over groups of t consecutive ranks (transformers' tensor-parallel plan) and the samples over the world/t
groups instead: every rank of a group runs the group's forwards, its first rank writes the group's files (as rank
r = rank // t of world/t). Every stage resumes: finished
regenerations and already-written samples are skipped on a rerun.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from tqdm import tqdm

from data_prep.capture import HiddenStateCapture, capture_samples
from data_prep.chat import Dropped, render_conversation, render_prompt, template_hash, tokenizer_hash
from data_prep.config import PrepConfig, held_out_count
from data_prep.conversations import Conversation, Message, SkipReport, load_conversations, split_conversations
from data_prep.fidelity import check_fidelity, probe_batch
from data_prep.rendered import (
    RENDERED_DIR,
    Rendered,
    RenderedSet,
    TargetSource,
    capture_order,
    has_rendered,
    write_spec,
    write_split,
)
from data_prep.shards import (
    PREP_SUMMARY,
    TARGET_CONFIG_FILE,
    TARGET_HEAD_FILE,
    ShardSpec,
    ShardWriter,
    bytes_per_token,
    completed_sample_ids,
    merge_manifests,
    sha256_file,
    write_prep_summary,
    writing,
)
from data_prep.targets import (
    TargetPreset,
    check_tensor_parallel,
    generation_eos,
    load_target,
    load_target_config,
    load_target_head,
    load_tokenizer,
    model_path,
    resolve_target,
    target_dtype,
    tensor_parallel_group,
)
from data_prep.vocab import (
    VOCAB_FILE,
    build_draft_vocab,
    count_tokens,
    coverage,
    save_draft_vocab,
    selection_scores,
)
from infra.config_keys import ConfigError
from infra.dirlock import claim, holding
from infra.files import save_safetensors
from infra.preemption import Preempted, StopSignals
from infra.strict_json import dumps
from models.config import check_trainable_target
from models.target_head import TargetHead

SPLITS = ("train", "eval")
CUT_UNMASKED = "regen: cut reply kept, its end of turn unmasked (regen.on_length=unmask)"  # replies
CUT_DROPPED = "regen: reply cut at regen.max_new_tokens (regen.on_length=drop)"  # conversations
NOT_SKIPS = ("captured_tokens", "truncated to max_len", CUT_UNMASKED)  # counted, but the sample is kept


def _world() -> tuple[int, int]:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    return rank, world


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of a device for its weights, activations and KV cache
DEVICE_CONTEXT_BYTES = 1 << 30  # what a CUDA context and allocator slack take besides the head's tensors


@dataclass(frozen=True)
class RankDevices:
    """Where a prep rank's pieces live: `head` (the target head, the fidelity probe and the compact teacher's
    top-k) and `hf_target` (the transformers target; None: not loaded) as prep's torch names devices, and
    `server`: the devices of the rank's own vLLM server as CUDA_VISIBLE_DEVICES names them (None: no server of
    prep's, or a node without devices). `note`: why, where a choice was made."""

    head: str
    hf_target: str | None
    server: str | None
    note: str = ""
    vllm: str = "none"  # started: a server of prep's own | user: vllm.urls | none: no vLLM

    def describe(self) -> str:
        server = {"started": f"vLLM server on devices {self.server}" if self.server is not None
                  else "vLLM server on the CPU", "user": "the user's vLLM servers", "none": "no vLLM server"}[self.vllm]
        return (f"{server}; head {self.head}; transformers target {self.hf_target or 'not loaded'}"
                + (f" ({self.note})" if self.note else ""))


def rank_devices(cfg: PrepConfig, plan: PrepPlan, *, local_rank: int, local_world: int, prep_devices: int,
                 node_devices: int = 0, visible: str | None = None, head_bytes: int = 0,
                 device_bytes: int | None = None) -> RankDevices:
    """The devices of local rank `local_rank` of `local_world` on its node (`prep_devices`: the CUDA devices prep's
    own torch sees; `node_devices`: those vLLM's own check counts, where the servers go; `visible`:
    CUDA_VISIBLE_DEVICES). Off the vLLM route, the rank's device as before (cuda:local_rank, or the CPU). On it, the
    rank's server takes its block of the node's devices (serving/server.py device_group), the head goes to that
    block's first device when it fits in the share vLLM leaves (`head_bytes` against `device_bytes`), else to host
    memory, and a transformers target never shares a device with a server: loaded after the servers stopped
    (plan.hf_target "after_regen") it takes the rank's first device; loaded beside them it needs a device no server
    of the node holds (the head goes with it), or ConfigError. With the user's servers (vllm.urls) prep cannot know which devices they
    hold: the head stays in host memory and a transformers target goes where `device=` says (required on a GPU
    node). An explicit `device=` places the head and the target there."""
    from serving.server import device_group

    hf = plan.hf_target is not None
    if not plan.vllm:
        device = cfg.device or (f"cuda:{local_rank}" if prep_devices else "cpu")
        return RankDevices(device, device if hf else None, None)
    if cfg.vllm.urls:
        if hf and prep_devices and not cfg.device:
            raise ConfigError("vllm.urls: prep cannot know which GPUs the user's servers hold, and this plan loads the "
                              f"transformers target too ({plan.why_hf}): set device= to a GPU they leave free, or "
                              "device=cpu")
        return RankDevices(cfg.device or "cpu", (cfg.device or "cpu") if hf else None, None,
                           "" if cfg.device else "the user's servers hold the node's devices", "user")
    group = cfg.vllm.tensor_parallel_size * cfg.vllm.pipeline_parallel_size
    server = device_group(local_rank, group, node_devices, visible)
    if cfg.device:
        return RankDevices(cfg.device, cfg.device if hf else None, server, "device= given", "started")
    if server is None or not prep_devices:
        note = "prep's torch sees no GPU" if server is not None else ""
        return RankDevices("cpu", "cpu" if hf else None, server, note, "started")
    first = local_rank * group  # the index of the server's first device among those visible to prep's torch too
    share = float(cfg.vllm.engine_kwargs.get("gpu_memory_utilization", GPU_MEMORY_UTILIZATION))
    head, note = f"cuda:{first}", ""
    if device_bytes is not None and head_bytes + DEVICE_CONTEXT_BYTES > (1 - share) * device_bytes:
        head, note = "cpu", (f"the head ({head_bytes / 2**30:.1f} GiB) does not fit beside the server's "
                             f"gpu_memory_utilization={share:g} of {device_bytes / 2**30:.0f} GiB: host memory")
    if not hf:
        return RankDevices(head, None, server, note, "started")
    if plan.hf_target == "after_regen":  # the servers are stopped (every rank's: a barrier) before it loads
        return RankDevices(head, f"cuda:{first}", server, note, "started")
    free = local_world * group + local_rank
    if free >= prep_devices:
        raise ConfigError(f"the transformers target ({plan.why_hf}) would share a GPU with a vLLM server: local rank "
                          f"{local_rank}'s would be device {free}, but the {local_world} servers of this node hold "
                          f"devices 0..{local_world * group - 1} of {prep_devices}. Regenerate on vLLM "
                          "(regen.backend=vllm), keep vllm.capture_fidelity=engine, or start fewer prep ranks per node")
    return RankDevices(f"cuda:{free}", f"cuda:{free}", server, "the head beside the transformers target", "started")


def select_conversations(cfg: PrepConfig) -> tuple[dict[str, list[Conversation]], dict]:
    """Load, split (seeded, by id) and cap the conversations; same answer on every rank.
    Besides the splits, "pool": every conversation that is not held out (what the draft vocabulary counts).
    No conversation to train on is an error here, before any target is loaded or anything written."""
    conversations, skips = load_conversations(cfg.data)
    if not conversations:
        raise ValueError(f"data {cfg.data!r}: no usable conversation\n{skips.summary()}")
    held = held_out_count(cfg.eval_samples, len(conversations))  # eval_samples=None: a share of the dataset
    pool, held_out = split_conversations(conversations, eval_count=held, seed=cfg.seed)
    if not pool:
        raise ValueError(f"data {cfg.data!r}: all {len(conversations)} usable conversations are held out "
                         f"(eval_samples={held}); none is left to train on")
    train = pool[: cfg.num_samples] if cfg.num_samples > 0 else pool
    return {"train": train, "eval": held_out, "pool": pool}, skips.to_dict()


COUNT_BATCH = 64  # conversations per batched count (data_prep/chat.py assistant_token_counts); `alive` before each


def dataset_token_counts(cfg: PrepConfig, tokenizer, convs: list[Conversation], preset: TargetPreset,
                         vocab_size: int, rank: int = 0, world: int = 1, alive=None) -> torch.Tensor:
    """Assistant (loss-masked) token counts of `convs` as the dataset wrote them, with the target's template:
    the large, forward-free count behind the draft vocabulary (this rank's share of it: every world-th
    conversation). Records the template refuses count nothing. `alive`: called before every COUNT_BATCH conversations
    counted (it raises to stop the count: prep's vLLM server died while the count ran beside its startup).

    The count equals render_conversation's samples counted one by one, but runs COUNT_BATCH conversations at a
    time (one tokenizer call each) and is cached: a share counted before, for the same conversations, tokenizer,
    template and settings, is read back (data_prep/vocab.py cached_counts)."""
    import numpy as np

    from data_prep.chat import assistant_token_counts
    from data_prep.vocab import cached_counts, count_cache_key

    if cfg.draft_vocab_count_max > 0:
        convs = convs[: cfg.draft_vocab_count_max]
    mine = [conv.messages for conv in convs[rank::world]]
    kwargs = template_kwargs(cfg, preset)

    def count() -> torch.Tensor:
        counts = np.zeros(vocab_size, dtype=np.int64)
        with tqdm(total=len(mine), desc="count tokens for the draft vocab", unit="conv", mininterval=5,
                  disable=rank != 0) as progress:
            for n in range(0, len(mine), COUNT_BATCH):
                if alive is not None:
                    alive()
                batch = mine[n : n + COUNT_BATCH]
                counts += assistant_token_counts(tokenizer, batch, max_len=cfg.max_len, vocab_size=vocab_size,
                                                 template_kwargs=kwargs)
                progress.update(len(batch))
        return torch.from_numpy(counts)

    key = count_cache_key(tokenizer, mine, {"template_kwargs": kwargs, "max_len": cfg.max_len,
                                            "vocab_size": vocab_size})
    return cached_counts(key, vocab_size, count)


def prompt_tokens(tokenizer, messages: list[Message], kwargs: dict) -> int:
    return len(render_prompt(tokenizer, messages, template_kwargs=kwargs))


def first_prompt(conv: Conversation) -> list[Message]:
    return conv.messages[: next(i for i, m in enumerate(conv.messages) if m.role == "assistant")]


def reply_room(cfg: PrepConfig) -> int:
    """The longest prompt (tokens) after which a whole reply of regen.max_new_tokens still fits under
    max_len: a longer one would be cut before its reply is complete, so it is not sent."""
    return cfg.max_len - cfg.regen.max_new_tokens


def plan_regeneration(cfg: PrepConfig, preset: TargetPreset, tokenizer, convs: list[Conversation]):
    """Shortest prompts first (batches pad less), and no conversation whose first reply cannot fit
    (reply_room); those are skipped (counted), not regenerated. Later turns are held to the same room
    during regeneration (regenerate_split), where a turn that does not fit ends its conversation."""
    kwargs = template_kwargs(cfg, preset)
    lengths = {c.id: prompt_tokens(tokenizer, first_prompt(c), kwargs) for c in convs}
    kept = sorted((c for c in convs if lengths[c.id] <= reply_room(cfg)), key=lambda c: lengths[c.id])
    return kept, len(convs) - len(kept)


def regen_window(cfg: PrepConfig, client, one_pass: bool) -> int:
    """Conversations regenerating at once: on the vLLM route as a stream (regen.stream), what the servers take
    (vllm.max_in_flight each), else regen.batch_size; with capture.one_pass at most as many as whose kept states
    (one file per conversation, at most max_len + 1 tokens each) fit the rank's vllm.scratch_gb."""
    window = client.capacity if client is not None and cfg.regen.stream else cfg.regen.batch_size
    if one_pass:
        per_sample = client.spec.max_model_len * client.spec.file_bytes_per_token()
        window = min(window, client.budget.limit // per_sample)
    return max(1, window)


def regenerate_split(cfg: PrepConfig, preset: TargetPreset, model, tokenizer, convs, path: Path, client=None,
                     should_stop=None, on_finished=None):
    """Replace assistant turns by the target's own replies; returns the ok conversations and counts. `model`: the
    transformers target (regen.backend=hf); `client`: prep's vLLM servers (regen.backend=vllm). `on_finished`
    (capture.one_pass, vllm): given each finished conversation and its last request's hidden states
    (data_prep/regenerate.py regenerate)."""
    from data_prep.regenerate import HFBackend, OpenAIBackend, VLLMBackend, load_regenerated, regenerate

    r = cfg.regen
    kwargs = template_kwargs(cfg, preset)
    thinking = r.enable_thinking if r.enable_thinking is not None else preset.enable_thinking
    if r.backend == "hf":
        backend = HFBackend(model, tokenizer, enable_thinking=thinking)
    elif r.backend == "vllm":
        backend = VLLMBackend(client, tokenizer, eos_token_id=generation_eos(preset), enable_thinking=thinking,
                              keep_states=on_finished is not None)
    else:
        backend = OpenAIBackend(
            base_url=r.base_url,
            model=r.served_model or preset.hf_id,
            api_key=os.environ.get(r.api_key_env) or "EMPTY",  # never from the config (RegenConfig.api_key_env)
            concurrency=r.concurrency,
            timeout_s=r.timeout_s,
            max_retries=r.max_retries,
            enable_thinking=thinking,
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    summary = regenerate(
        convs,
        backend,
        path,
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        batch_size=regen_window(cfg, client if r.backend == "vllm" else None, on_finished is not None),
        max_turns=r.max_turns,
        prompt_fits=lambda messages: prompt_tokens(tokenizer, messages, kwargs) <= reply_room(cfg),
        should_stop=should_stop,
        on_finished=on_finished,
        stream=r.stream,
        seed=cfg.seed,
    )
    ok = {c.id: c for c in load_regenerated(path)}
    return [ok[c.id] for c in convs if c.id in ok], summary.to_dict()


def template_kwargs(cfg: PrepConfig, preset: TargetPreset) -> dict:
    thinking = cfg.regen.enable_thinking if cfg.regen.enable_thinking is not None else preset.enable_thinking
    return {} if thinking is None else {"enable_thinking": thinking}


def render_all(cfg: PrepConfig, tokenizer, convs: list[Conversation], preset: TargetPreset):
    """The training samples of `convs`. A regenerated reply cut at regen.max_new_tokens (Message.cut) never teaches
    the end of turn after it (render_conversation leaves it out of the mask); regen.on_length=drop skips its
    conversation instead. Both are counted."""
    rendered, counts = [], Counter()
    for conv in convs:
        cut = sum(m.cut for m in conv.messages)
        if cut and cfg.regen.on_length == "drop":
            counts[CUT_DROPPED] += 1
            continue
        result = render_conversation(
            tokenizer, conv.messages, max_len=cfg.max_len, overflow=cfg.overflow,
            template_kwargs=template_kwargs(cfg, preset),
        )
        if isinstance(result, Dropped):
            counts[f"render: {result.reason}"] += 1
            continue
        if result.truncated:
            counts["truncated to max_len"] += 1
        mask = torch.tensor(result.loss_mask, dtype=torch.bool)
        if not mask[1:].any():
            counts["render: no trainable assistant token"] += 1
            continue
        counts[CUT_UNMASKED] += cut
        rendered.append(Rendered(conv.id, torch.tensor(result.input_ids), mask))
    return rendered, counts


def length_batches(samples: list[Rendered], batch_tokens: int) -> list[list[Rendered]]:
    """Group length-sorted samples so that padded batch size x length stays under batch_tokens."""
    batches: list[list[Rendered]] = []
    for s in capture_order(samples):
        if batches and (len(batches[-1]) + 1) * len(s.input_ids) <= batch_tokens:
            batches[-1].append(s)
        else:
            batches.append([s])
    return batches


def capture_split(cfg, head, capture, spec, samples, root: Path, rank: int, device: str,
                  signals: StopSignals | None = None, group=None) -> dict:
    """Capture `samples` into this rank's shards (`rank`: the shard files' rank). `group`: a tensor-parallel group
    (capture.tensor_parallel_size > 1): its ranks hold the same samples and run the same forwards together; its
    first rank writes them. SIGTERM/SIGUSR1 (infra/preemption.py, `signals`) end it after the batch in flight: its samples
    go into a last shard, recorded, and Preempted (exit status 75) is raised; a rerun captures the rest."""
    write = group is None or dist.get_rank(group) == 0
    writer = ShardWriter(root, spec, rank=rank, tokens_per_shard=cfg.capture.tokens_per_shard) if write else None
    done = completed_sample_ids(root)
    if group is not None:  # the writer's record decides what is left, so every rank of the group runs the same batches
        box = [done]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        done = box[0]
    todo = [s for s in samples if s.conversation_id not in done]
    tokens, start = 0, time.perf_counter()
    bar = tqdm(total=sum(len(s.input_ids) for s in todo), unit="tok", desc=f"capture {root.name} r{rank}",
               disable=rank != 0)
    stop = 0
    with ExitStack() as stack:
        if signals is None:  # the caller's (prep's, installed for the whole run), else this capture's own
            signals = stack.enter_context(StopSignals(f"capture of {root.name}"))
        for batch in length_batches(todo, cfg.capture.batch_tokens):
            # a group runs its forwards together, so its ranks agree on stopping (one int over the group)
            stop = signals.received if group is None else signals.agreed(device, group)
            if stop:
                break
            for sample in capture_samples(capture, head, spec, batch, device):
                if writer is not None:
                    writer.add(sample)
                tokens += len(sample)
            bar.update(sum(len(s.input_ids) for s in batch))
    bar.close()
    if writer is not None:
        writer.close()
    if stop:
        raise Preempted(stop)
    return {"samples": len(todo), "tokens": tokens, "seconds": time.perf_counter() - start,
            "skipped_already_done": len(samples) - len(todo), "bytes_written": writer.bytes_written if write else 0}


def _regen_path(out: Path, split: str, part: int, group, seed: int) -> Path:
    """Where this rank's regeneration of `split` goes: out/regen/{split}.r{part}.jsonl. In a tensor-parallel group
    every rank generates (the forwards are collective) and its first rank writes that file; the others write a copy
    of it, taken before anyone starts, so a resumed run skips the same conversations on every rank of the group;
    and the same seed makes a sampled reply (regen.temperature > 0) the same on each."""
    path = out / "regen" / f"{split}.r{part}.jsonl"
    if group is None:
        return path
    torch.manual_seed(seed + part)
    dist.barrier(group=group)
    if dist.get_rank(group) != 0:
        mirror = out / "regen" / ".tensor_parallel" / f"{split}.r{part}.t{dist.get_rank(group)}.jsonl"
        mirror.parent.mkdir(parents=True, exist_ok=True)
        mirror.write_bytes(path.read_bytes() if path.exists() else b"")
        path = mirror
    dist.barrier(group=group)
    return path


def save_target_files(head: TargetHead, target_config, tokenizer, out: Path) -> None:
    """`target_config`: the target's transformers config as prep loaded it (its dtype)."""
    with writing(out / TARGET_HEAD_FILE):
        head.save(out / TARGET_HEAD_FILE, dtype=torch.float32)
    with writing(out / TARGET_CONFIG_FILE):
        config = {k: v for k, v in target_config.to_dict().items() if k != "distributed_config"}
        (out / TARGET_CONFIG_FILE).write_text(dumps(config, indent=1, default=str))
    with writing(out / "tokenizer"):
        tokenizer.save_pretrained(out / "tokenizer")


def preflight(cfg: PrepConfig, preset: TargetPreset, tap_layers: list[int]) -> None:
    """Before the target's weights load: its tokenizer has a chat template (or `chat_template=` gives one), and
    nothing of its config or the tap layers is what training would refuse (models.config.check_trainable_target, the
    same checks the drafter config runs when training builds it)."""
    load_tokenizer(preset, cfg.chat_template)
    config = load_target_config(preset)
    check_tensor_parallel(config, cfg.capture.tensor_parallel_size, int(os.environ.get("WORLD_SIZE", 1)),
                          f"target {preset.name!r}, capture.tensor_parallel_size")
    try:
        check_trainable_target(config, tap_layers)
    except ValueError as e:
        family = config.get("model_type") or "?"
        raise ValueError(f"target {preset.name!r} ({family}), capture.tap_layers={tap_layers}: {e}. Training would "
                         "refuse this prep, so nothing was prepared.") from e


def print_fidelity(result: dict) -> None:
    diffs = result["max_abs_diff"]
    taps = max(v for k, v in diffs.items() if k.startswith("tap "))
    print(f"fidelity ({result['family']}, {result['dtype']}, {result['tokens']} probe tokens): max abs difference "
          f"logits {diffs['LM head']:.3g}, final norm {diffs['final norm']:.3g}, taps {taps:.3g}, embedding "
          f"{diffs['input embedding']:.3g}; argmax agreement {result['argmax_agreement']:.3f}")


def write_draft_vocab(cfg: PrepConfig, out: Path, vocab_size: int, dataset_counts: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """<out>/draft_vocab.safetensors from the train split's loss tokens (+ the dataset-wide count): its rendered
    samples (the same ids and masks as its shards, without reading any feature), or a prep's shards from before them."""
    from data_prep.shards import ShardSet

    train = RenderedSet(out, "train") if has_rendered(out, "train") else ShardSet(out / "train", verify="none")
    counts = count_tokens(((s.input_ids, s.loss_mask) for s in train), vocab_size)
    scores = selection_scores(counts, dataset_counts, cfg.draft_vocab_train_weight)
    d2t, t2d = build_draft_vocab(scores, cfg.draft_vocab_size)
    # written whole beside the old file, then put in its place: stage=vocab rewrites it in a finished prep
    tmp = out / (VOCAB_FILE + ".tmp")
    with writing(tmp):
        save_draft_vocab(tmp, d2t, t2d, counts, dataset_counts, scores)
    os.replace(tmp, out / VOCAB_FILE)
    return d2t, t2d, counts, dataset_counts


def with_preset_defaults(cfg: PrepConfig, preset: TargetPreset) -> PrepConfig:
    """`cfg` with what it leaves to the target preset filled in: the draft vocabulary size, and the dtype the
    target computes in (the preset's unless `dtype` is set; "auto" resolved for prep's `device`, by default this
    machine's compute device, where prep's engines and transformers target run: infra/precision.py)."""
    return replace(cfg, dtype=target_dtype(preset, cfg.dtype, cfg.device),
                   draft_vocab_size=preset.draft_vocab_size if cfg.draft_vocab_size is None else cfg.draft_vocab_size)


def rebuild_draft_vocab(cfg: PrepConfig) -> dict:
    """`stage=vocab`: a finished prep's draft vocabulary built anew (e.g. another size or count), no model;
    summary.json's vocabulary fields are updated. Each file is written whole under a temporary name and then
    replaces the old one, the summary last: an interrupted rebuild leaves the prep finished, with its old
    vocabulary or the new one, never a torn file (interrupted between the two, the summary's vocabulary fields
    describe the old one until stage=vocab is rerun)."""
    from transformers import AutoTokenizer

    preset = resolve_target(cfg.model)
    cfg = with_preset_defaults(cfg, preset)
    out = Path(cfg.out)
    summary_path = out / PREP_SUMMARY
    if not summary_path.exists():
        raise FileNotFoundError(f"{summary_path} is missing: stage=vocab needs a finished prep in {out}")
    summary = json.loads(summary_path.read_text())
    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
    splits, _ = select_conversations(cfg)
    vocab_size = int(json.loads((out / TARGET_CONFIG_FILE).read_text())["vocab_size"])
    dataset_counts = None
    if cfg.draft_vocab_count == "dataset":
        dataset_counts = dataset_token_counts(cfg, tokenizer, splits["pool"], preset, vocab_size)
    d2t, t2d, counts, dataset_counts = write_draft_vocab(cfg, out, vocab_size, dataset_counts)
    summary.update(vocab_summary(cfg, d2t, t2d, counts, dataset_counts))
    write_prep_summary(out, summary)
    print(f"draft vocab {summary['draft_vocab_size']} ids → {out / VOCAB_FILE}")
    return summary


def vocab_summary(cfg: PrepConfig, d2t, t2d, counts, dataset_counts) -> dict:
    return {
        "draft_vocab_size": int(d2t.numel()),
        "draft_vocab_coverage": coverage(counts, t2d),  # of the training split's loss tokens
        "draft_vocab_count": {"source": cfg.draft_vocab_count, "train_weight": cfg.draft_vocab_train_weight,
                              "dataset_tokens": int(dataset_counts.sum()) if dataset_counts is not None else 0,
                              "dataset_coverage": coverage(dataset_counts, t2d) if dataset_counts is not None
                              else None},
    }


def split_sizes(out: Path, captured: bool) -> tuple[dict[str, int], dict[str, int], int]:
    """(samples per split, tokens per split, shard bytes): from the merged manifests (written here) of a prep
    that captured, else (stage=render) from its rendered samples, which training runs the target on."""
    if not captured:
        sets = {split: RenderedSet(out, split) for split in SPLITS}
        return {s: len(sets[s]) for s in SPLITS}, {s: sum(sets[s].lengths()) for s in SPLITS}, 0
    manifests = {split: merge_manifests(out / split) for split in SPLITS}
    size = sum((out / split / s.file).stat().st_size for split, m in manifests.items() for s in m.shards)
    return ({s: manifests[s].num_samples for s in SPLITS}, {s: manifests[s].num_tokens for s in SPLITS}, size)


def finish(cfg: PrepConfig, out: Path, spec: ShardSpec, head: TargetHead, target_config, tokenizer,
           world: int) -> dict:
    """Rank 0, after every rank closed its writers: manifests, draft vocab, target files, and the summary last,
    which marks the prep finished (data_prep/shards.py finished_prep)."""
    (out / PREP_SUMMARY).unlink(missing_ok=True)  # unfinished from the first rewritten file on
    samples, tokens, shard_bytes = split_sizes(out, captured=cfg.stage == "all")
    dataset_counts = None
    if cfg.draft_vocab_count == "dataset":  # every rank counted its share (run)
        dataset_counts = sum(load_file(str(out / f"dataset_counts.r{r}.safetensors"))["counts"] for r in range(world))
    d2t, t2d, counts, dataset_counts = write_draft_vocab(cfg, out, spec.vocab_size, dataset_counts)
    save_target_files(head, target_config, tokenizer, out)

    parts = [json.loads((out / f"summary.r{r}.json").read_text()) for r in range(world)]
    total = Counter()
    for p in parts:
        total.update(p["counts"])
    options = {
        name: bytes_per_token(replace(spec, **kw))
        for name, kw in {
            "hidden teacher, bf16 taps (default)": {"teacher": "hidden", "taps_dtype": "bfloat16"},
            "hidden teacher, fp8 taps": {"teacher": "hidden", "taps_dtype": "float8_e4m3fn"},
            f"top-{cfg.capture.topk} teacher, fp8 taps": {
                "teacher": "topk", "teacher_topk": cfg.capture.topk, "taps_dtype": "float8_e4m3fn"},
            "argmax teacher, fp8 taps": {"teacher": "argmax", "taps_dtype": "float8_e4m3fn"},
        }.items()
    }
    capture_s = max(p["capture_seconds"] for p in parts) or 1e-9
    summary = {
        "target": spec.target,
        "tap_layers": spec.tap_layers,
        "teacher": spec.teacher,
        "taps_dtype": spec.taps_dtype,
        # what the target computed in: the fidelity probe, capture, and regeneration on prep's own engine
        "dtype": cfg.dtype,
        "stage": cfg.stage,  # render: no shards (train with data.source=online|hybrid)
        "shards": cfg.stage == "all",
        "samples": samples,
        "eval_samples_requested": cfg.eval_samples,  # 0: made without a held-out split (training says so)
        "tokens": tokens,
        "loss_tokens_train": int(counts.sum()),
        "skipped": {k: v for k, v in sorted(total.items()) if k not in NOT_SKIPS},
        "truncated_to_max_len": total["truncated to max_len"],
        "loader_skips": parts[0]["loader_skips"],
        "regen": [p.get("regen") for p in parts],
        **regen_counts(cfg, total, [p.get("regen") or {} for p in parts]),
        "bytes_written": shard_bytes,
        "rendered_bytes": sum(p.stat().st_size for p in (out / RENDERED_DIR).iterdir() if p.is_file()),
        "bytes_per_token": bytes_per_token(spec)["total"],
        "bytes_per_token_options": {k: v["total"] for k, v in options.items()},
        "capture_tokens_per_s": total["captured_tokens"] / capture_s,
        **vocab_summary(cfg, d2t, t2d, counts, dataset_counts),
        "target_head_sha256": sha256_file(out / TARGET_HEAD_FILE),
        "target_head": asdict(head.spec),
        "fidelity": parts[0]["fidelity"],  # rank 0's probe; every rank checked its own
        **capture_pass_summary(out, parts, captured=cfg.stage == "all"),
        # the slowest rank's stages in this launch, wall-clock: regeneration (with one pass, its capture too),
        # the capture stage, and the whole launch up to its part of the summary
        "wall_s": {k: max(p.get("seconds", {}).get(k, 0.0) for p in parts) for k in ("regen", "capture", "prep")},
    }
    write_prep_summary(out, summary)
    return summary


def capture_pass_summary(out: Path, parts: list[dict], captured: bool) -> dict:
    """How each split's samples were captured (`capture_pass`: {split: {with_regeneration, prefill}}, from the
    shards; data_prep/vllm_capture.py capture_passes) and, with capture.one_pass, what the one pass left to the
    prefill (`one_pass.not_covered`, this launch's) and its next-token agreement (greedy regeneration: the head on
    the teacher of a request's last computed position against the token vLLM generated next)."""
    from data_prep.shards import Manifest
    from data_prep.vllm_capture import capture_passes

    passes = {split: capture_passes(out / split, Manifest.from_file(out / split / "manifest.json").shards)
              for split in SPLITS} if captured else None
    stats = [p["one_pass"] for p in parts if p.get("one_pass") is not None]
    if not stats:
        return {"capture_pass": passes, "one_pass": {"enabled": False}}
    checked = sum(st["checked"] for part in stats for st in part.values())
    agreed = sum(st["agreed"] for part in stats for st in part.values())
    return {"capture_pass": passes,
            "one_pass": {"enabled": True,
                         "not_covered": {split: sum(part.get(split, {}).get("not_covered", 0) for part in stats)
                                         for split in SPLITS},
                         "next_token_agreement": agreed / checked if checked else None}}


def run(cfg: PrepConfig) -> dict | None:
    cfg.validate()
    if cfg.stage == "vocab":
        if int(os.environ.get("RANK", 0)) != 0:
            return None
        with holding(cfg.out, "prep"):  # rank 0's work alone; one writer per prep dir (infra/dirlock.py)
            return rebuild_draft_vocab(cfg)
    rank, world = _world()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    lock = claim(out, "prep", rank, world)  # one writer per prep dir (infra/dirlock.py)
    try:
        return _run_claimed(cfg, out, rank, world)
    finally:  # released on an error too: a failed prep must not keep its directory locked in this process
        if lock is not None:
            lock.release()


@dataclass(frozen=True)
class PrepPlan:
    """What a prep runs, decided once from its config (`plan_prep`) before anything loads."""

    regen: str | None  # the backend that regenerates the replies: hf | vllm | openai; None: the dataset's replies
    capture: str | None  # the engine that captures: hf | vllm; None: stage=render (no shards)
    # when the transformers target loads: "first" (before anything else runs on it), "after_regen" (once the vLLM
    # servers regenerated and stopped: the devices are its then) or None (never: the head's tensors alone)
    hf_target: str | None
    why_hf: str = ""  # what the transformers target is loaded for (errors name it)
    # capture.one_pass on the vLLM route with regeneration: the regeneration's own requests capture (no prefill
    # pass over a sample they cover)
    one_pass: bool = False

    @property
    def vllm(self) -> bool:
        """Prep talks to vLLM servers (started by it, or vllm.urls)."""
        return "vllm" in (self.regen, self.capture)

    @property
    def vllm_extracts(self) -> bool:
        """The servers serve with the hidden-state extraction: they capture after regenerating."""
        return self.capture == "vllm"


def plan_prep(cfg: PrepConfig) -> PrepPlan:
    """The stages of `cfg` (validated): which backend regenerates, which engine captures, and whether and when the
    transformers target loads. It loads for the HF capture, the render stage's fidelity probe, regeneration with
    regen.backend=hf, and vllm.capture_fidelity=hf; capture.engine=vllm otherwise reads the target's head alone
    (load_target_head): vLLM holds the layers, so a target larger than one device never loads whole into a prep
    process. After a vLLM regeneration it loads only once the servers are stopped."""
    regen = cfg.regen.backend if cfg.regen.enabled else None
    capture = cfg.capture.engine if cfg.stage == "all" else None
    needs_hf = (capture != "vllm" or regen == "hf"
                or (capture == "vllm" and cfg.vllm.capture_fidelity == "hf"))
    why = ("capture.engine=hf" if capture == "hf" else "regen.backend=hf" if regen == "hf"
           else "vllm.capture_fidelity=hf" if capture == "vllm" else "the render stage's fidelity probe")
    return PrepPlan(regen=regen, capture=capture,
                    hf_target=None if not needs_hf else "after_regen" if regen == "vllm" and capture != "vllm"
                    else "first", why_hf=why if needs_hf else "",
                    one_pass=cfg.capture.one_pass and regen == "vllm" and capture == "vllm")


def rank_servers(cfg: PrepConfig, plan: PrepPlan, preset: TargetPreset, tap_layers: list[int], python: str | None,
                 cuda: bool, devices: RankDevices, part: int, rank: int, world: int, out: Path, should_stop):
    """This rank's vLLM servers (serving/client.py): `with` starts them (they build in the background) or
    connects to the user's."""
    from serving.client import ServerSpec, VLLMClient
    from serving.states import engine_layer_ids

    spec = ServerSpec(model=model_path(preset), dtype=cfg.dtype, max_model_len=cfg.max_len + 1,
                      hidden_size=preset.hidden_size,
                      layer_ids=engine_layer_ids(tap_layers, preset.num_layers) if plan.vllm_extracts else [],
                      tensor_parallel_size=cfg.vllm.tensor_parallel_size,
                      pipeline_parallel_size=cfg.vllm.pipeline_parallel_size,
                      engine_kwargs=dict(cfg.vllm.engine_kwargs))
    local_rank, local_world = _local()
    return VLLMClient(spec, cfg.vllm, python=python, cuda=cuda, rank=rank, local_rank=local_rank,
                      local_world=local_world, devices=devices.server, log_path=out / f"vllm.r{part}.log",
                      should_stop=should_stop)


def _local() -> tuple[int, int]:
    return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def head_bytes(preset: TargetPreset, dtype: str) -> int:
    """The target head's tensors (input embedding and LM head; the norm is negligible) in prep's dtype."""
    size = 4 if dtype == "float32" else 2
    return 2 * preset.vocab_size * preset.hidden_size * size


def plan_devices(cfg: PrepConfig, plan: PrepPlan, preset: TargetPreset, node_devices: int) -> RankDevices:
    """This rank's RankDevices, from the node's devices as vLLM counts them and prep's own torch."""
    local_rank, local_world = _local()
    prep_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device_bytes = None
    if plan.vllm and prep_devices:
        group = cfg.vllm.tensor_parallel_size * cfg.vllm.pipeline_parallel_size
        device_bytes = torch.cuda.get_device_properties(min(local_rank * group, prep_devices - 1)).total_memory
    return rank_devices(cfg, plan, local_rank=local_rank, local_world=local_world, prep_devices=prep_devices,
                        node_devices=node_devices, visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                        head_bytes=head_bytes(preset, cfg.dtype), device_bytes=device_bytes)


def stop_point(signals: StopSignals) -> None:
    """A boundary between prep's stages: Preempted (exit 75) if a stop signal came (every stage resumes)."""
    if signals.received:
        raise Preempted(signals.received)


def _run_claimed(cfg: PrepConfig, out: Path, rank: int, world: int) -> dict | None:
    run_start = time.perf_counter()
    seconds = {"regen": 0.0, "capture": 0.0}  # this launch's stages, wall-clock (a resumed launch: its own)
    preset = resolve_target(cfg.model)
    cfg = with_preset_defaults(cfg, preset)
    plan = plan_prep(cfg)
    tap_layers = list(cfg.capture.tap_layers or preset.tap_layers)

    splits, loader_skips = select_conversations(cfg)
    cfg = replace(cfg, eval_samples=len(splits["eval"]))  # the default's share, as summary.json records it
    preflight(cfg, preset, tap_layers)
    tp_size = cfg.capture.tensor_parallel_size
    # tensor parallel: the samples are split over the groups (part `part` of `parts`); a group's first rank writes
    part, parts, writes = rank // tp_size, world // tp_size, rank % tp_size == 0
    with ExitStack() as stack:
        # SIGTERM/SIGUSR1 anywhere in the prep: a clean stop at the next boundary, or at once while waiting on vLLM
        signals = stack.enter_context(StopSignals("prep"))

        def should_stop() -> int:
            return signals.received

        python, cuda, node_devices = None, False, 0
        if plan.vllm and not cfg.vllm.urls:
            from serving.client import VLLM_PLUGIN
            from serving.server import ready

            python, info = ready(cfg.vllm.python, VLLM_PLUGIN)
            cuda, node_devices = bool(info.get("cuda")), int(info.get("device_count") or 0)
        devices = plan_devices(cfg, plan, preset, node_devices)  # before anything loads: refuses what cannot fit
        if rank == 0:
            print(f"prep devices, local rank 0: {devices.describe()}")
        client = None
        if plan.vllm:  # first: a server that cannot start fails the prep before any other long work
            client = stack.enter_context(rank_servers(cfg, plan, preset, tap_layers, python, cuda, devices, part,
                                                      rank, world, out, should_stop))
        model = None
        if plan.hf_target == "first":
            model, tokenizer = load_target(preset, cfg.dtype, devices.hf_target, chat_template=cfg.chat_template,
                                           tensor_parallel=tp_size)
            head, target_config = TargetHead.from_hf_model(model), model.config
            head = head.to(devices.head)
        else:  # vLLM holds the layers (or regenerates before the transformers target loads): the head's tensors alone
            tokenizer = load_tokenizer(preset, cfg.chat_template)
            head, target_config = load_target_head(preset, cfg.dtype)
            head = head.to(devices.head)
        spec = shard_spec(cfg, preset, tap_layers, head, target_config, tokenizer)
        write_spec(out, spec, TargetSource(model=str(Path(preset.local_path).resolve()) if preset.local_path
                                           else cfg.model, dtype=cfg.dtype,
                                           chat_template=cfg.chat_template))

        def alive() -> None:  # beside the servers' start-up: they are checked, and a stop signal stops the count
            if client is not None:
                client.check_starting()
            stop_point(signals)

        if cfg.draft_vocab_count == "dataset" and writes:  # forward-free: beside the servers' startup
            share = dataset_token_counts(cfg, tokenizer, splits["pool"], preset, spec.vocab_size, part, parts,
                                         alive=alive)
            save_safetensors({"counts": share}, out / f"dataset_counts.r{part}.safetensors")
        stop_point(signals)
        if client is not None:
            client.wait_ready()
        probe = probe_batch(tokenizer, splits["train"], cfg.max_len, template_kwargs(cfg, preset))
        capture = fidelity = None
        if model is not None:
            capture, fidelity = attach_target(stack, model, head, tap_layers, probe, devices.hf_target, rank)
        counts: Counter = Counter()
        mine_by_split = {split: splits[split][part::parts] for split in SPLITS}
        regen_summary: dict = {}
        one_pass, one_pass_stats, engine_probe = None, {}, None
        if plan.one_pass:  # the regeneration writes samples: the probe is judged before it starts
            from data_prep import vllm_capture

            engine_probe = vllm_capture.check_probe(model, head, spec, probe, client)
            greedy = cfg.regen.temperature == 0

            def one_pass(split: str):
                def render(conv):
                    samples, _ = render_all(cfg, tokenizer, [conv], preset)  # counted once, by render_splits
                    return samples[0] if samples else None

                return vllm_capture.OnePassCapture(client, spec, head, out / split, part,
                                                   cfg.capture.tokens_per_shard, render, greedy)

            if rank == 0 and regen_window(cfg, client, True) < regen_window(cfg, client, False):
                print(f"capture.one_pass: {regen_window(cfg, client, True)} conversations regenerating at once, those "
                      f"whose states fit vllm.scratch_gb={cfg.vllm.scratch_gb}")
        stage_start = time.perf_counter()
        if plan.regen is not None:
            group = tensor_parallel_group(model)
            mine_by_split, regen_summary, one_pass_stats = regenerate_splits(
                cfg, preset, model, tokenizer, mine_by_split, out, part, group, client, counts, should_stop, one_pass)
        seconds["regen"] = time.perf_counter() - stage_start
        stop_point(signals)
        if plan.hf_target == "after_regen":  # the servers' devices are the transformers target's now
            client.close()
            _barrier(world)  # every rank's server stopped before any target loads onto a server's device
            model, tokenizer = load_target(preset, cfg.dtype, devices.hf_target, chat_template=cfg.chat_template,
                                           tensor_parallel=tp_size)
            capture, fidelity = attach_target(stack, model, head, tap_layers, probe, devices.hf_target, rank)
        rendered = render_splits(cfg, preset, tokenizer, mine_by_split, out, part, parts, writes, counts)
        stop_point(signals)
        stage_start = time.perf_counter()
        captured = {"tokens": sum(st["tokens"] for st in one_pass_stats.values()),
                    "seconds": sum(st["seconds"] for st in one_pass_stats.values())}
        fidelity = dict(fidelity or {})
        if plan.capture == "hf":
            for split, samples in rendered.items():
                stats = capture_split(cfg, head, capture, spec, samples, out / split, part, devices.hf_target,
                                      signals, tensor_parallel_group(model))
                captured["tokens"] += stats["tokens"]
                captured["seconds"] += stats["seconds"]
        elif plan.capture == "vllm":
            from data_prep import vllm_capture

            vllm_stats, fidelity["vllm"] = vllm_capture.capture_prep(
                cfg, model, head, spec, {split: (samples, out / split) for split, samples in rendered.items()},
                part, probe, client, should_stop, checked=engine_probe)
            captured["tokens"] += sum(st["tokens"] for st in vllm_stats.values())
            captured["seconds"] += sum(st["seconds"] for st in vllm_stats.values())
        seconds["capture"] = time.perf_counter() - stage_start
        counts["captured_tokens"] += captured["tokens"]
    seconds["prep"] = time.perf_counter() - run_start
    if writes:
        (out / f"summary.r{part}.json").write_text(dumps(
            {"counts": counts, "loader_skips": loader_skips, "regen": regen_summary,
             "capture_seconds": captured["seconds"], "fidelity": fidelity, "devices": asdict(devices),
             "one_pass": one_pass_stats if plan.one_pass else None, "seconds": seconds},
            default=dict))
    _barrier(world)
    summary = finish(cfg, out, spec, head, target_config, tokenizer, parts) if rank == 0 else None
    _barrier(world)
    if rank == 0:
        print_summary(summary, out)
    return summary


def shard_spec(cfg: PrepConfig, preset: TargetPreset, tap_layers: list[int], head: TargetHead, target_config,
               tokenizer) -> ShardSpec:
    """The shard sets' spec (data_prep/shards.py): the target, taps, teacher, dtype, hashes and max_len."""
    return ShardSpec(
        target={"id": preset.hf_id, "revision": preset.revision, "architecture": target_config.architectures[0]
                if target_config.architectures else target_config.model_type,
                "num_layers": preset.num_layers, "hidden_size": preset.hidden_size,
                "vocab_size": head.lm_head.weight.shape[0]},
        tap_layers=tap_layers,
        teacher=cfg.capture.teacher,
        teacher_topk=cfg.capture.topk if cfg.capture.teacher == "topk" else 0,
        taps_dtype=cfg.capture.taps_dtype,
        tokenizer_hash=tokenizer_hash(tokenizer),
        chat_template_hash=template_hash(tokenizer),
        max_len=cfg.max_len,
    )


def attach_target(stack: ExitStack, model, head: TargetHead, tap_layers: list[int], probe, device: str, rank: int):
    """The transformers target's hooks (closed with `stack`), and the fidelity probe on them before anything of it
    is used: (capture, fidelity result)."""
    capture = stack.enter_context(HiddenStateCapture(model, tap_layers))
    fidelity = check_fidelity(model, head, capture, *(x.to(device) for x in probe))
    if rank == 0:
        print_fidelity(fidelity)
    return capture, fidelity


def regenerate_splits(cfg: PrepConfig, preset: TargetPreset, model, tokenizer, mine_by_split: dict, out: Path,
                      part: int, group, client, counts: Counter, should_stop=None,
                      one_pass=None) -> tuple[dict, dict, dict]:
    """Every split's conversations of this part with the target's own replies: (conversations kept per split,
    regeneration summary per split, one-pass capture stats per split); the ones whose first prompt leaves no room
    are counted in `counts`. `one_pass(split)` (capture.one_pass): the split's data_prep/vllm_capture.py
    OnePassCapture, which writes the samples its regeneration's requests cover; it is closed (its last shard
    written) however the regeneration ends."""
    kept, summary, captured = {}, {}, {}
    for split, mine in mine_by_split.items():
        mine, too_long = plan_regeneration(cfg, preset, tokenizer, mine)
        counts["regen: first prompt leaves no room for a reply under max_len"] += too_long
        path = _regen_path(out, split, part, group, cfg.seed)
        sink = one_pass(split) if one_pass is not None else None
        try:
            kept[split], summary[split] = regenerate_split(cfg, preset, model, tokenizer, mine, path, client,
                                                           should_stop, sink)
        finally:
            if sink is not None:
                captured[split] = sink.close()
    return kept, summary, captured


def render_splits(cfg: PrepConfig, preset: TargetPreset, tokenizer, mine_by_split: dict, out: Path, part: int,
                  parts: int, writes: bool, counts: Counter) -> dict[str, list[Rendered]]:
    """Every split's training samples in the order the part's shards will hold them, written to <out>/rendered/
    (what online training reads) by the part's writing rank: those the regeneration already wrote (one pass) in
    their shards' order, then the rest in capture order, so a rendered set and its prep's shard set list the same
    samples in the same order (offline and online training draw the same batches). What rendering dropped is
    counted in `counts`."""
    from data_prep.shards import recorded_sample_ids

    rendered = {}
    for split, mine in mine_by_split.items():
        samples, render_counts = render_all(cfg, tokenizer, mine, preset)
        counts.update(render_counts)
        written = {sid: k for k, sid in enumerate(recorded_sample_ids(out / split, part))}
        rendered[split] = sorted(capture_order(samples),
                                 key=lambda s: (s.conversation_id not in written, written.get(s.conversation_id, 0)))
        if writes:
            write_split(out, split, part, parts, rendered[split])
    return rendered


def regen_counts(cfg: PrepConfig, total: Counter, regen: list[dict]) -> dict:
    """What regeneration left out of or changed in the samples, beside the skips: replies cut at
    regen.max_new_tokens (kept with their end of turn unmasked, or their conversations dropped: regen.on_length)
    and the assistant turns after the first regen.max_turns, which are not trained on."""
    splits = [s for part in regen for s in part.values()]
    seconds = max((sum(s.get("elapsed_s", 0.0) for s in part.values()) for part in regen), default=0.0)
    tokens = sum(s.get("generated_tokens", 0) for s in splits)
    return {
        # generated tokens over the slowest rank's regeneration time (this run's: resumed replies not counted)
        "regen_tokens_per_s": tokens / seconds if seconds else None,
        "regen_cut_replies": {"on_length": cfg.regen.on_length, "max_new_tokens": cfg.regen.max_new_tokens,
                              "kept_end_of_turn_unmasked": total[CUT_UNMASKED],
                              "conversations_dropped": total[CUT_DROPPED]},
        "regen_later_turns_dropped": {"max_turns": cfg.regen.max_turns,
                                      "turns": sum(s.get("later_turns_dropped", 0) for s in splits),
                                      "conversations": sum(s.get("conversations_with_later_turns_dropped", 0)
                                                           for s in splits)},
    }


def print_summary(summary: dict, out: Path) -> None:
    print(f"\nprep finished → {out}")
    print(f"  samples  train {summary['samples']['train']}  eval {summary['samples']['eval']}")
    print(f"  tokens   train {summary['tokens']['train']}  eval {summary['tokens']['eval']}  "
          f"(loss tokens {summary['loss_tokens_train']})")
    print("  " + SkipReport.from_dict(summary["loader_skips"]).summary().replace("\n", "\n  "))
    for reason, n in summary["skipped"].items():
        print(f"  skipped {n:>7}  {reason}")
    print(f"  truncated to max_len (kept) {summary['truncated_to_max_len']}")
    cut, later = summary["regen_cut_replies"], summary["regen_later_turns_dropped"]
    if cut["kept_end_of_turn_unmasked"] or cut["conversations_dropped"]:
        print(f"  regen    replies cut at max_new_tokens={cut['max_new_tokens']}, regen.on_length={cut['on_length']}: "
              f"{cut['kept_end_of_turn_unmasked']} kept with the end of turn unmasked, "
              f"{cut['conversations_dropped']} conversations dropped")
    if later["turns"]:
        print(f"  regen    {later['turns']} later assistant turns of {later['conversations']} conversations not "
              f"trained on (regen.max_turns={later['max_turns']})")
    regen_rate = summary["regen_tokens_per_s"]
    print(f"  target   {summary['dtype']}" + ("" if regen_rate is None else f"; regeneration {regen_rate:.0f} tokens/s"))
    print(f"  written  {summary['bytes_written'] / 2**20:.1f} MiB, {summary['bytes_per_token']} B/token; "
          f"capture {summary['capture_tokens_per_s']:.0f} tokens/s")
    for name, b in summary["bytes_per_token_options"].items():
        print(f"  storage option {name}: {b} B/token")
    dataset = summary["draft_vocab_count"]["dataset_coverage"]
    print(f"  draft vocab {summary['draft_vocab_size']} ids, coverage of the train split's loss tokens "
          f"{summary['draft_vocab_coverage']:.3f}" + ("" if dataset is None else f", of the dataset's {dataset:.3f}"))

