"""`capture.engine=vllm`: prep's capture stage through vLLM's own hidden-state extraction, written by ShardWriter.

The capture runs on prep's vLLM servers (serving/client.py: `vllm serve` started by prep in vLLM's own venv,
`vllm.python`, or the user's `vllm.urls`), serving with the `extract_hidden_states` speculative method and a
hidden-states KV connector; with regen.backend=vllm the same servers have regenerated the replies first. Each
rendered sample's token ids go to them as a prompt with max_tokens=1. vLLM records the residual stream after the
layers it is asked for (its aux layer id k is the output of decoder layer k-1; `aux_layer_ids`): each tap layer i
(id i+1) and the last layer's output before the final norm (id num_layers), the hidden teacher. This side reads each
file as its answer arrives (in the order sent), checks that its token ids are the sample's and its shape
[T, ids, H], builds the shard Sample exactly as the HF capture does (data_prep/capture.py capture_samples: taps
joined in tap order, a compact teacher from the prep's target head), writes it with the rank's ShardWriter and
deletes the file.

One pass (capture.one_pass, with regen.backend=vllm): the regeneration's requests keep the states of their prompt
and reply (vLLM's `include_output_tokens`), and OnePassCapture writes each regenerated sample from its final
request's file as the conversation finishes (one_pass_features: the rows no objective reads, from the request's
last generated token on, are zeros); the probe goes first (check_probe), and the capture stage then prefills only
the samples not yet recorded: those the states do not cover. capture_passes counts the samples captured each way.

Resume: samples already recorded in a split's partial manifests are not sent again; nothing is sent when every
sample is recorded. SIGTERM/SIGUSR1 (infra/preemption.py) stop the capture at the next sample, or at once while it
waits for an answer, also when the signal reached the server too and it exited (SLURM signals every process of the
step): the samples written go into a last shard, recorded, the requests still in flight are dropped with the
servers, and Preempted (exit status 75) is raised; a rerun captures the rest. Any other failure also closes the
shard writers first, so nothing written is lost. Fidelity: the prep's probe batch goes first, before any
sample is written: the prep's target head on vLLM's teacher must give vLLM's own top-1 next token at every probe
position (data_prep/fidelity.py check_engine_head; no transformers copy of the target is loaded: prep reads the
head's tensors alone), and with vllm.capture_fidelity=hf check_engine_fidelity also compares every tap and the
teacher with the target's transformers forward. Every captured sample's last position is checked the same way
(`next_token_agreement` in the summary).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch

from data_prep.capture import compact_teacher
from data_prep.rendered import Rendered, capture_order
from data_prep.shards import Sample, ShardSpec, ShardWriter, completed_sample_ids
from infra.preemption import Preempted, StopSignals
from infra.strict_json import dumps
from models.target_head import TargetHead
from serving.client import VLLMClient
from serving.states import aux_layer_ids, features_from_file, read_states

PROBE = "probe:"
SAMPLE = "sample:"


def one_pass_features(hs: torch.Tensor, ids: torch.Tensor, rendered: Rendered, columns: list[int],
                      teacher: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(taps [T, n_taps*H], teacher hidden [T, H]) of a rendered sample from its final regeneration request's states
    (`hs` [n, ids, H] and `ids` [n]: the prompt and every generated token but the last), or None where they do not
    cover it: its tokens are not the request's (a template that renders earlier turns otherwise than their
    prompts did, a reply whose content is not its generated ids), or a loss-masked token lies past position n (the
    request's last generated token, normally the end of turn).

    The EAGLE-3, EAGLE-1 and DFlash objectives read a position j's taps and teacher only where some later
    position is loss-masked (train/ttt.py: p_j is a target where loss_mask[j+1]; its inputs are the taps at
    t < j), so with nothing masked past position n, every row they read is one the request computed. Rows from n
    on (the end-of-turn token and the template's tail after it, e.g. `<|im_end|>` then `\n`, which the connector
    does not hold) are zeros; a sample cut by max_len within the request's tokens is covered whole."""
    n, length = ids.shape[0], len(rendered.input_ids)
    shared = min(n, length)
    if not torch.equal(rendered.input_ids[:shared].long(), ids[:shared]):
        return None
    if length > n + 1 and bool(rendered.loss_mask[n + 1:].any()):
        return None
    taps = torch.zeros(length, len(columns) * hs.shape[-1], dtype=hs.dtype)
    final = torch.zeros(length, hs.shape[-1], dtype=hs.dtype)
    taps[:shared] = torch.cat([hs[:shared, c] for c in columns], dim=-1)
    final[:shared] = hs[:shared, teacher]
    return taps, final


def build_sample(rendered: Rendered, taps: torch.Tensor, final_hidden: torch.Tensor, spec: ShardSpec,
                 head: TargetHead) -> Sample:
    """The shard Sample data_prep/capture.py capture_samples builds for the same features."""
    teacher = {}
    if spec.teacher != "hidden":
        device = head.lm_head.weight.device
        got = compact_teacher(head, final_hidden[None].to(device), spec.teacher, spec.teacher_topk)
        teacher = {k: v[0].cpu() for k, v in got.items()}
    return Sample(sample_id=rendered.conversation_id, input_ids=rendered.input_ids, loss_mask=rendered.loss_mask,
                  taps=taps, teacher_hidden=final_hidden if spec.teacher == "hidden" else None, **teacher)


def stream_features(client: VLLMClient, tap_layers: list[int], num_layers: int, hidden_size: int,
                    items: list[tuple[str, torch.Tensor]],
                    logprobs: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor, torch.Tensor, dict]]:
    """Capture `items` ((key, token ids), in order) on the client's servers and yield (key, taps, teacher hidden,
    engine) as their answers arrive, in order; `engine`: vLLM's own next-token choice (serving/client.py
    next_tokens: its greedy next token, and for the keys in `logprobs` its top-1 at every position)."""
    ids, columns, teacher = aux_layer_ids(tap_layers, num_layers)
    if list(client.spec.layer_ids) != ids:
        raise ValueError(f"the servers extract aux layers {client.spec.layer_ids}, the capture needs {ids}")
    tokens = dict(items)
    for key, path, engine in client.capture([(k, t.tolist()) for k, t in items], logprobs=logprobs):
        taps, final = features_from_file(path, tokens[key], key, columns, teacher, len(ids), hidden_size,
                                         client.spec.dtype, client.where)
        yield key, taps, final, engine


def capture_splits(client: VLLMClient, spec: ShardSpec, head: TargetHead,
                   splits: dict[str, tuple[list[Rendered], Path]], rank: int, tokens_per_shard: int,
                   probe: list[torch.Tensor] | None = None,
                   check_probe: Callable[[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[dict]],
                                         dict] | None = None,
                   should_stop: Callable[[], int] | None = None) -> tuple[dict[str, dict], dict | None]:
    """Capture every split's samples not yet recorded (split -> (rendered samples, shard set root)) on the
    client's servers, each written by its split's ShardWriter in capture order. `probe` (token id sequences) goes
    first; `check_probe(probe, taps, teachers, engine)` judges it before any sample is written (its result is
    returned; `engine`: vLLM's own top-1 per position, stream_features). Per split: samples, tokens, seconds,
    skipped_already_done, bytes_written, as pipeline.capture_split, and `next_token_agreement`: of the samples
    captured, the share whose last position's teacher gives, through `head`, the token vLLM itself chose.
    `should_stop()` (the stop signal received, prep's StopSignals; else this function's own): checked after every
    sample written and while waiting for the next answer; the samples written go into a last shard either way, and
    so do they when anything else fails (the module docstring)."""
    writers, todo, stats = {}, {}, {}
    for split, (samples, root) in splits.items():
        writers[split] = ShardWriter(root, spec, rank=rank, tokens_per_shard=tokens_per_shard)
        done = completed_sample_ids(root)
        todo[split] = {s.conversation_id: s for s in capture_order(samples) if s.conversation_id not in done}
        stats[split] = {"samples": 0, "tokens": 0, "seconds": 0.0,
                        "skipped_already_done": len(samples) - len(todo[split]), "bytes_written": 0}
    items = [(f"{PROBE}{i}", ids) for i, ids in enumerate(probe or [])]
    probe_keys = frozenset(k for k, _ in items)
    items += [(f"{SAMPLE}{split}:{sid}", s.input_ids) for split in todo for sid, s in todo[split].items()]
    fidelity, stop = None, 0
    if any(todo.values()):
        got_probe: dict[str, tuple[torch.Tensor, torch.Tensor, dict]] = {}
        agreed = {split: 0 for split in todo}
        start = time.perf_counter()
        features = stream_features(client, spec.tap_layers, spec.target["num_layers"], spec.target["hidden_size"],
                                   items, logprobs=probe_keys)
        with ExitStack() as stack:
            if should_stop is None:
                signals = stack.enter_context(StopSignals("vLLM capture"))
                should_stop = lambda: signals.received  # noqa: E731
            try:
                for key, taps, final, engine in features:
                    if key.startswith(PROBE):
                        got_probe[key] = (taps, final, engine)
                        if len(got_probe) == len(probe) and check_probe is not None:
                            order = [got_probe[f"{PROBE}{i}"] for i in range(len(probe))]
                            fidelity = check_probe(probe, *map(list, zip(*order)))
                        continue
                    split, sid = key[len(SAMPLE):].split(":", 1)
                    sample = build_sample(todo[split][sid], taps, final, spec, head)
                    writers[split].add(sample)
                    stats[split]["samples"] += 1
                    stats[split]["tokens"] += len(sample)
                    agreed[split] += int(head_choice(head, final[-1]) == engine["next_token"])
                    if should_stop():
                        stop = should_stop()
                        break
            except Preempted as e:  # the stop came while waiting for an answer
                stop = e.signum
            except BaseException:
                for writer in writers.values():  # nothing written is lost: a rerun skips what is recorded
                    writer.close()
                raise
            finally:
                features.close()  # the requests still in flight: dropped (their files go with the launch's scratch)
        # one set of servers serves every split: its wall time (start-up excluded) is shared by their tokens
        elapsed = time.perf_counter() - start
        total = sum(s["tokens"] for s in stats.values()) or 1
        for split, s in stats.items():
            s["seconds"] = elapsed * s["tokens"] / total
            s["vllm_startup_s"] = client.startup_s
            s["next_token_agreement"] = agreed[split] / s["samples"] if s["samples"] else None
    for split, writer in writers.items():
        writer.close()
        stats[split]["bytes_written"] = writer.bytes_written
    if stop:
        raise Preempted(stop)
    return stats, fidelity


@torch.no_grad()
def head_choice(head: TargetHead, teacher_row: torch.Tensor) -> int:
    """The target's greedy token after a position, from its teacher hidden state through the prep's head."""
    return int(head.logits(teacher_row.to(head.lm_head.weight.device)[None]).argmax(-1)[0])


def engine_judge(model, head: TargetHead, spec: ShardSpec) -> Callable[..., dict]:
    """The probe's judge (capture_splits' `check_probe`): the head against vLLM's own top-1 at every position
    (data_prep/fidelity.py check_engine_head), and, where prep loaded the transformers target (`model` not None:
    vllm.capture_fidelity=hf), every tap against its forward (check_engine_fidelity)."""
    from data_prep.fidelity import check_engine_fidelity, check_engine_head

    def judge(seqs, taps, teachers, engine) -> dict:
        result = check_engine_head(head, seqs, teachers, engine)
        print(f"vLLM capture fidelity ({result['dtype']}, {result['tokens']} probe tokens): the prep's head on vLLM's "
              f"teacher gives vLLM's own top-1 at {result['argmax_agreement']:.4f} of the positions, log-probability "
              f"of that token within {result['max_logprob_diff']:.3g}")
        if model is not None:
            result["hf"] = check_engine_fidelity(model, head, spec.tap_layers, seqs, taps, teachers)
            rel = max(v for k, v in result["hf"]["max_rel_diff"].items() if k.startswith("tap "))
            print(f"vLLM capture against the transformers forward: max relative difference taps {rel:.3g}, teacher "
                  f"{result['hf']['max_rel_diff']['teacher']:.3g}; argmax agreement "
                  f"{result['hf']['argmax_agreement']:.3f}")
        return result

    return judge


def probe_sequences(probe: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
    ids, mask = probe
    return [ids[i][mask[i].bool()] for i in range(ids.shape[0])]


def check_probe(model, head: TargetHead, spec: ShardSpec, probe: tuple[torch.Tensor, torch.Tensor],
                client: VLLMClient) -> dict:
    """The probe batch alone, captured and judged (engine_judge): what capture.one_pass runs before the
    regeneration writes any sample."""
    seqs = probe_sequences(probe)
    items = [(f"{PROBE}{i}", s) for i, s in enumerate(seqs)]
    got = list(stream_features(client, spec.tap_layers, spec.target["num_layers"], spec.target["hidden_size"], items,
                               logprobs=frozenset(k for k, _ in items)))
    return engine_judge(model, head, spec)(seqs, *map(list, zip(*((t, f, e) for _, t, f, e in got))))


def capture_prep(cfg, model, head, spec: ShardSpec, splits: dict[str, tuple[list[Rendered], Path]], part: int,
                 probe: tuple[torch.Tensor, torch.Tensor], client: VLLMClient,
                 should_stop: Callable[[], int] | None = None,
                 checked: dict | None = None) -> tuple[dict[str, dict], dict]:
    """Prep's capture stage through vLLM (data_prep/pipeline.py run, capture.engine=vllm): every split's samples
    of this rank not yet recorded on its servers, the probe batch checked first (engine_judge), unless `checked`
    gives its result already (check_probe, before a one-pass regeneration). Returns (stats per split, the probe's
    fidelity result or {} when nothing was left)."""
    stats, fidelity = capture_splits(client, spec, head, splits, part, cfg.capture.tokens_per_shard,
                                     None if checked is not None else probe_sequences(probe),
                                     engine_judge(model, head, spec), should_stop)
    return stats, checked if checked is not None else fidelity or {}


# ------------------------------------------------------------------------------------------------------------
# One pass (capture.one_pass): the features of a regenerated sample from its final regeneration request

WITH_REGENERATION, PREFILL = "with_regeneration", "prefill"  # summary.json's capture_pass
CAPTURE_PASS_FILE = "capture_pass.r{rank}.jsonl"  # per shard set: the shards written from regeneration requests


class OnePassCapture:
    """`on_finished` of a split's regeneration (data_prep/regenerate.py) with capture.one_pass: each finished
    conversation rendered (`render`: its sample, or None where rendering drops it), its features taken from the
    states its final request kept (one_pass_features), the sample written by the split's ShardWriter for this rank.
    A sample they do not cover is left to the prefill capture that follows (capture_splits: it captures every
    sample not yet recorded). The shards it records are listed in `<split>/capture_pass.r{rank}.jsonl`
    (capture_passes counts from it), each after its manifest records it. `close()` writes the last shard: call it
    however the regeneration ended, so nothing written is lost.

    Stats: samples, tokens, seconds (reading the files and writing the shards), not_covered (left to the prefill),
    and next-token agreement: at temperature 0 (`greedy`), whether the prep's head on the teacher of the request's
    last computed position gives the token vLLM generated next."""

    def __init__(self, client: VLLMClient, spec: ShardSpec, head: TargetHead, root: Path, rank: int,
                 tokens_per_shard: int, render: Callable[[object], Rendered | None], greedy: bool):
        ids, self.columns, self.teacher = aux_layer_ids(spec.tap_layers, spec.target["num_layers"])
        if list(client.spec.layer_ids) != ids:
            raise ValueError(f"the servers extract aux layers {client.spec.layer_ids}, the capture needs {ids}")
        self.num_ids, self.client, self.spec, self.head = len(ids), client, spec, head
        self.render, self.greedy = render, greedy
        self.writer = ShardWriter(root, spec, rank=rank, tokens_per_shard=tokens_per_shard)
        self.done = completed_sample_ids(root)
        self.listing = Path(root) / CAPTURE_PASS_FILE.format(rank=rank)
        self.recorded = len(self.writer.manifest.shards)
        self.stats = {"samples": 0, "tokens": 0, "seconds": 0.0, "not_covered": 0, "agreed": 0, "checked": 0}

    def __call__(self, conversation, states) -> None:
        if states is None:  # the backend kept none (a reply whose states went with an earlier turn's request)
            return
        start = time.perf_counter()
        rendered = self.render(conversation)
        if rendered is None or rendered.conversation_id in self.done:
            return
        hs, ids = read_states(states.path, rendered.conversation_id, self.num_ids, self.spec.target["hidden_size"],
                              self.client.spec.dtype, self.client.where)
        got = one_pass_features(hs, ids, rendered, self.columns, self.teacher)
        if got is None:
            self.stats["not_covered"] += 1
            return
        taps, final = got
        self.writer.add(build_sample(rendered, taps, final, self.spec, self.head))
        self.done.add(rendered.conversation_id)
        self._list_recorded()
        self.stats["samples"] += 1
        self.stats["tokens"] += len(rendered.input_ids)
        n = ids.shape[0]
        if self.greedy and n <= len(rendered.input_ids):
            self.stats["checked"] += 1
            self.stats["agreed"] += int(head_choice(self.head, final[n - 1]) == states.last_token)
        self.stats["seconds"] += time.perf_counter() - start

    def _list_recorded(self) -> None:
        shards = self.writer.manifest.shards
        if len(shards) > self.recorded:
            with open(self.listing, "a") as f:
                for shard in shards[self.recorded:]:
                    f.write(dumps({"shard": shard.file, "samples": len(shard.sample_ids),
                                   "capture_pass": WITH_REGENERATION}) + "\n")
            self.recorded = len(shards)

    def close(self) -> dict:
        """The last shard written and listed; returns the stats."""
        self.writer.close()
        self._list_recorded()
        self.stats["bytes_written"] = self.writer.bytes_written
        return self.stats


def capture_passes(root: Path, shards: list) -> dict[str, int]:
    """How the samples of a shard set (`shards`: its merged manifest's) were captured: {with_regeneration, prefill}
    (the shards OnePassCapture listed; the rest by the prefill capture)."""
    recorded = {s.file: len(s.sample_ids) for s in shards}
    listed: set[str] = set()
    for path in Path(root).glob(CAPTURE_PASS_FILE.format(rank="*")):
        for line in path.read_text().splitlines():
            if line.strip():
                listed.add(json.loads(line)["shard"])
    one = sum(n for f, n in recorded.items() if f in listed)
    return {WITH_REGENERATION: one, PREFILL: sum(recorded.values()) - one}
