"""train.on_policy (Draft-OPD): training on the drafter's own rollouts against the target, instead of on trajectories
the target wrote alone.

`OnPolicySamples` is a sample source (train/online.py's interface: train/data.py's sampler, cursor, collate and the
train loop are unchanged). Sample i is a rollout of prep's rendered sample i's first prompt (its tokens before the
first loss-masked one) by the *rollout drafter* in chains of train.on_policy.depth drafts against the target
(train/rollout.py: lossless, so the continuation is the target's), then the target's taps and exact teacher over
prompt + continuation, captured as the run captures any sample. The sample carries `draft_steps`, the (anchor, TTT
step) pairs the rollout visited, so the TTT loss replays exactly that drafting with the drafter being trained, against
the target's distribution there: on the accepted proposals and at each rejected one (train/ttt.py target_rows). A
block drafter (DFlash) drafts its whole block a cycle and trains each cycle's block on the verified positions
(train/dflash.py BlockPlan.replayed).

The target is where the run's source has it (`RolloutTarget`): in the ranks (data.source=online, any
data.target_placement) or on vLLM's servers (data.source=vllm). Greedy rollouts (temperature 0) need of it only
plain greedy generation and the capture: the continuation is the target's greedy text whatever the drafter proposes,
and the chains are replayed along it from the rollout drafter's teacher-forced drafts (train/rollout.py
greedy_accepts), in the rank. So every rank of a ZeRO-3 or tensor-parallel target runs the same forwards
(generation in lockstep, one batched call a step), and a server answers two plain requests a rollout. Sampled
rollouts (temperature > 0) decode speculatively in the rank with a whole copy of the target (data.target_placement=
replicate): which tokens come out depends on the drafts.

The rollout drafter is a frozen copy of the trained one, refreshed from the trained weights every
train.on_policy.refresh_interval optimizer steps (`refresh`, collective); its weights and the step they are from are
part of every checkpoint (`state`), so a resumed run rolls out with the very drafter the interrupted one had. A
sampled rollout (temperature > 0) draws from a generator seeded by (train.seed, the sample's id, that step): the
rollouts of a resumed run are the interrupted run's, bit for bit. Rollouts are spread over the ranks as the samples
are (each rank rolls out its part of every global batch).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from data_prep.rendered import Rendered
from data_prep.shards import Sample, as_read_back
from train.batch import collate, tap_columns
from train.config import OnPolicyConfig
from train.rollout import Rollout, greedy_accepts, rollout

ROLLOUT_PREFIX = "rollout/"  # the rollout drafter's tensors in a checkpoint's model.safetensors
# Per-step statistics (summed over the ranks between two log lines): metrics.jsonl's rollout_* and replay_*.
COUNTERS = ("rollouts", "rollouts_generated", "rollouts_reused", "rollout_new_tokens", "rollout_cycles",
            "rollout_accepted", "replay_pairs", "replay_rejected", "rollout_s")


@dataclass
class RolloutSample(Sample):
    """A shard sample of a rollout, with the TTT steps inference visited from each position (train/rollout.py)."""

    draft_steps: Tensor | None = None


def prompt_length(loss_mask: Tensor) -> int:
    """Tokens before the first loss-masked one: the first turn's prompt (0 when the sample has no loss token)."""
    hits = loss_mask.nonzero()
    return int(hits[0, 0]) if hits.numel() else 0


class RolloutTarget:
    """The target the rollouts run against, where the run's source has it: `generate` (greedy continuations) and
    `capture` (shard samples, as read back) are what greedy rollouts ask of it; `model` (a whole HF copy in this
    rank, else None) is what sampled ones decode with."""

    model: nn.Module | None = None

    def generate(self, prompts: list[list[int]], budgets: list[int], stop: tuple[int, ...]) -> list[list[int]]:
        raise NotImplementedError

    def capture(self, rendered: list[Rendered]) -> list[Sample]:
        raise NotImplementedError

    def stats(self) -> dict:
        raise NotImplementedError


class RankTarget(RolloutTarget):
    """The frozen target of online training (train/online.py OnlineSamples: its FrozenTarget, placed per
    data.target_placement). A whole copy generates and captures sample by sample (unpadded, as online training
    captures: a rollout is a function of its prompt and drafter alone, whatever the batch or world size); a
    partitioned or split one in ONE batched call per step on every rank, what keeps their collectives in step."""

    def __init__(self, online):
        self.online, self.frozen = online, online.target
        self.batched = online.batched
        self.model = self.frozen.model if not self.batched else None
        tok = self.frozen.tokenizer
        pad = None if tok is None else (tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        self.pad_id = 0 if pad is None else int(pad)  # left padding, masked out
        self._own_head: nn.Module | None = None

    def generate(self, prompts: list[list[int]], budgets: list[int], stop: tuple[int, ...]) -> list[list[int]]:
        from data_prep.regenerate import hf_generate_ids

        model = self.frozen.model
        if not self.batched:
            return [hf_generate_ids(model, [p], n, stop, self.pad_id)[0] if n > 0 else []
                    for p, n in zip(prompts, budgets)]
        mine = len(prompts)
        if self.frozen.group is not None:  # tp: the group generates every rank's prompts, the same forwards
            import torch.distributed as dist

            parts: list = [None] * dist.get_world_size(self.frozen.group)
            dist.all_gather_object(parts, (prompts, budgets), group=self.frozen.group)
            before = sum(len(part[0]) for part in parts[: dist.get_rank(self.frozen.group)])
            prompts, budgets = [p for part in parts for p in part[0]], [n for part in parts for n in part[1]]
            rows = hf_generate_ids(model, prompts or [[self.pad_id]], max([*budgets, 1]), stop, self.pad_id)
            return [row[:n] for row, n in zip(rows, budgets)][before : before + mine]
        return self._lockstep_greedy(prompts, budgets, stop)

    @torch.no_grad()
    def _lockstep_greedy(self, prompts: list[list[int]], budgets: list[int], stop: tuple[int, ...]) -> list[list[int]]:
        """Greedy decoding with a ZeRO-3-partitioned target: its decoder (the partitioning engine's module, whose
        hooks gather each layer for its forward) with a KV cache, the next token from a whole copy of the LM head
        (the engine leaves it out: capture never needs it); every rank runs forwards until every rank's rows have
        ended, its own rows (or a one-token stand-in) each time."""
        import torch.distributed as dist
        from transformers import DynamicCache

        from data_prep.capture import base_model

        rows = prompts or [[self.pad_id]]
        limits = budgets if prompts else [0]
        width = max(len(p) for p in rows)
        device = self.frozen.device
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in rows], device=device)
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=device)
        pos = (attn.cumsum(-1) - 1).clamp_min(0)
        lm_head = self._lm_head()
        out: list[list[int]] = [[] for _ in rows]
        done = [n < 1 for n in limits]
        cache = DynamicCache()
        while True:
            hidden = base_model(self.frozen.model)(input_ids=ids, attention_mask=attn, position_ids=pos,
                                                   past_key_values=cache, use_cache=True).last_hidden_state
            nxt = lm_head(hidden[:, -1].to(lm_head.weight.dtype)).argmax(-1)
            for b, token in enumerate(nxt.tolist()):
                if not done[b]:
                    out[b].append(token)
                    done[b] = token in stop or len(out[b]) >= limits[b]
            going = torch.tensor([0 if all(done) else 1], device=device)
            dist.all_reduce(going, op=dist.ReduceOp.MAX)
            if not int(going):
                return out[: len(prompts)]
            ids, pos = nxt[:, None], pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)

    def _lm_head(self) -> nn.Module:
        """The LM head: the compact teacher's whole copy where the target has one (FrozenTarget.head), else one
        gathered once from the partitions (a collective: the first greedy call, on every rank at once)."""
        if self.frozen.head is not None:
            return self.frozen.head.lm_head
        if self._own_head is None:
            from models.target_head import TargetHead, final_norm
            from train.engine import gathered

            model = self.frozen.model
            weight = model.get_output_embeddings().weight
            with gathered([model.get_input_embeddings().weight, weight, *final_norm(model).parameters()]):
                self._own_head = copy.deepcopy(TargetHead.from_hf_model(model).lm_head).to(self.frozen.device)
        return self._own_head

    def capture(self, rendered: list[Rendered]) -> list[Sample]:
        forwards = [rendered] if self.batched else [[r] for r in rendered]
        return [as_read_back(s, self.online.manifest) for part in forwards for s in self.frozen.samples(part)]

    def stats(self) -> dict:
        return self.online.stats()


class ServedTarget(RolloutTarget):
    """vLLM's servers of data.source=vllm (train/served.py ServedSamples): a greedy request per rollout, then the
    capture request of prompt + continuation, as the run asks any sample's features."""

    def __init__(self, served):
        self.served = served

    def generate(self, prompts: list[list[int]], budgets: list[int], stop: tuple[int, ...]) -> list[list[int]]:
        asked = [i for i, n in enumerate(budgets) if n > 0]
        rows = dict(zip(asked, self.served.features.generate([prompts[i] for i in asked],
                                                              [budgets[i] for i in asked], stop)))
        out = []
        for i, n in enumerate(budgets):
            row = rows.get(i, [])
            cut = next((j + 1 for j, t in enumerate(row) if t in stop), len(row))
            out.append(row[: min(cut, n)])
        return out

    def capture(self, rendered: list[Rendered]) -> list[Sample]:
        got = dict(self.served.features.stream(list(enumerate(rendered))))
        return [as_read_back(got[i], self.served.manifest) for i in range(len(rendered))]

    def stats(self) -> dict:
        return self.served.stats()


class OnPolicySamples:
    """The train split's prompts rolled out with the rollout drafter (see the module docstring). `base`: the
    split's source of the run (OnlineSamples or ServedSamples: its rendered samples), `target`: where its target
    runs; `stop_ids`: the target's end-of-turn / EOS ids."""

    def __init__(self, base, target: RolloutTarget, settings: OnPolicyConfig, max_len: int, seed: int,
                 stop_ids: tuple[int, ...]):
        self.base, self.target, self.settings, self.max_len, self.seed = base, target, settings, max_len, seed
        self.stop_ids = tuple(stop_ids)
        self._prompts = [prompt_length(base.rendered[i].loss_mask) for i in range(len(base))]
        self.drafter: nn.Module | None = None
        self.depth = settings.depth  # drafts per verify cycle (start() says for the rollout drafter's family)
        self.drafter_step = 0  # the optimizer step whose weights the rollout drafter holds
        self.counts = dict.fromkeys(COUNTERS, 0.0)
        self.totals = dict.fromkeys(COUNTERS, 0.0)
        self.captures, self.capture_tokens, self.capture_s = 0, 0, 0.0  # the target's captures of the rollouts
        # A greedy rollout's text (the target's greedy continuation) is the same every epoch: found once per
        # sample and kept (int32 ids; a resumed run finds it again, the same text); the capture and the replay,
        # which depend on nothing kept, run each time.
        self._greedy: dict[int, Tensor] = {}
        self.head: nn.Module | None = None  # the target head: checks that prep's reply is the greedy text

    def __str__(self) -> str:
        return f"{self.base} rolled out on-policy"

    @property
    def manifest(self):
        return self.base.manifest

    def __len__(self) -> int:
        return len(self.base)

    def sample_ids(self) -> list[str]:
        return self.base.sample_ids()

    def lengths(self) -> list[int]:
        """Upper bounds (the sampler buckets by them): the prompt and max_new_tokens, cut at data.max_len."""
        return [min(p + self.settings.max_new_tokens, self.max_len) for p in self._prompts]

    # -- the rollout drafter --------------------------------------------------------------------------------------
    def start(self, drafter: nn.Module, device: torch.device, dtype: torch.dtype, step: int = 0,
              state: dict[str, Tensor] | None = None, head: nn.Module | None = None) -> None:
        """The rollout drafter: a frozen copy of `drafter` (before the engine takes it) on this rank's device, with
        the weights of `state` (a checkpoint's, `state()`) where a run resumes. `head`: the target head (the
        trainer's), with which a greedy rollout reuses prep's reply where it is the target's greedy text."""
        from models.registry import family_of_drafter

        self.head = head

        self.drafter = copy.deepcopy(drafter).to(device=device, dtype=dtype).eval().requires_grad_(False)
        # drafts per verify cycle: a block drafter's whole block (as it decodes), else train.on_policy.depth
        self.depth = drafter.block_size - 1 if family_of_drafter(drafter).block_drafting else self.settings.depth
        self.refresh(state or {}, step)

    def refresh(self, params: dict[str, Tensor], step: int) -> None:
        """`params` (the trained weights, Engine.full_params(all_ranks=True), full fp32; or a checkpoint's) into the
        rollout drafter, which then holds step `step`'s weights."""
        own = self.drafter.state_dict()
        unknown = sorted(set(params) - set(own))
        if unknown:
            raise KeyError(f"rollout drafter weights {unknown[:4]} are not the drafter's")
        with torch.no_grad():
            for name, value in params.items():
                own[name].copy_(value.to(own[name].dtype))
        self.drafter_step = step

    def state(self) -> dict[str, Tensor]:
        """The rollout drafter's trained tensors for a checkpoint (the target's frozen ones are the prep's)."""
        trained = {n for n, p in self.drafter.named_parameters()}
        from models.registry import family_of_drafter

        frozen = set(family_of_drafter(self.drafter).frozen_keys)
        return {n: t.detach().float().cpu().clone() for n, t in self.drafter.state_dict().items()
                if n in trained and n not in frozen}

    # -- samples --------------------------------------------------------------------------------------------------
    def _generator(self, sample_id: str) -> torch.Generator | None:
        digest = hashlib.sha256(f"{self.seed}/{sample_id}/{self.drafter_step}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))

    def _plan(self, i: int) -> tuple[list[int], int]:
        """Sample i's prompt and how many tokens its rollout may add within data.max_len (0: none, the prompt fills
        it or the sample has no prompt: a rollout of its first token(s) without a loss row)."""
        rendered = self.base.rendered[i]
        prompt = rendered.input_ids[: self._prompts[i]].tolist()
        if not prompt:
            return rendered.input_ids[:1].tolist(), 0
        return prompt[: self.max_len], max(min(self.settings.max_new_tokens, self.max_len - len(prompt)), 0)

    def _prep_reply(self, i: int, budget: int) -> list[int] | None:
        """Prep's reply to sample i's first prompt as a greedy rollout of `budget` tokens would be: up to its first
        stop id, at most `budget` tokens; None where it cannot be one (a reply that ends, cut or truncated, short of
        both: what the target says after it is not in the sample)."""
        rendered, start = self.base.rendered[i], self._prompts[i]
        masked = rendered.loss_mask[start:].int().cumprod(0)  # the first turn's loss-masked run
        reply = rendered.input_ids[start : start + int(masked.sum())].tolist()
        end = next((j + 1 for j, t in enumerate(reply) if t in self.stop_ids), None)
        if end is None and len(reply) < budget:
            return None
        return reply[: min(end or budget, budget)]

    @torch.no_grad()
    def _is_greedy(self, sample: Sample, prompt_len: int) -> bool:
        """Whether, at every position of the continuation, the target's argmax (its teacher through the head, or
        the compact teacher's top-1) is the next token: the continuation is the target's greedy text, computed by
        the capture's forward. A text that parts from it at a near-tie is not taken; the target generates that one."""
        rows = slice(prompt_len - 1, len(sample.input_ids) - 1)
        if sample.teacher_hidden is not None:
            if self.head is None:
                return False
            weight = self.head.lm_head.weight
            top = self.head.logits(sample.teacher_hidden[rows].to(weight.device, weight.dtype)).argmax(-1)
        elif sample.teacher_argmax is not None:
            top = sample.teacher_argmax[rows]
        elif sample.teacher_topk_ids is not None:
            top = sample.teacher_topk_ids[rows, 0]
        else:
            return False
        return torch.equal(top.cpu().long(), sample.input_ids[prompt_len:].long())

    def _sampled(self, distinct: list[int]) -> list[Rollout]:
        """Speculative decoding at train.on_policy.temperature with the family's rollout function (in the rank)."""
        from models.registry import family_of_drafter

        decode = family_of_drafter(self.drafter).rollout_fn
        out = []
        for i in distinct:
            prompt, budget = self._plan(i)
            if budget < 1:
                out.append(Rollout(len(prompt), prompt, [], self.depth))
                continue
            generator = self._generator(self.base.rendered[i].conversation_id)
            generate = functools.partial(decode, self.target.model, self.drafter, depth=self.depth,
                                         temperature=self.settings.temperature, eos_token_ids=self.stop_ids,
                                         generator=generator)
            out.append(rollout(generate, prompt, budget, self.depth))
        return out

    def _replayed(self, distinct: list[int], samples: list[Sample]) -> list[Rollout]:
        """Greedy rollouts' verify cycles, replayed along the captured continuations with the rollout drafter."""
        from models.registry import family_of_drafter

        drafts_of = family_of_drafter(self.drafter).greedy_drafts_fn
        device = next(self.drafter.parameters()).device
        source = list(self.manifest.tap_layers)  # the capture's taps; the drafter reads its own among them
        columns = tap_columns(source, self.drafter.tap_layers, "the rollouts' capture")
        out = []
        for i, sample in zip(distinct, samples):
            batch = collate([sample]).select_taps(columns, len(source)).to(device)
            drafts = drafts_of(self.drafter, batch, self.depth)[0].cpu()
            tokens, prompt_len = sample.input_ids.tolist(), len(self._plan(i)[0])
            out.append(Rollout(prompt_len, tokens, greedy_accepts(tokens, prompt_len, drafts, self.depth), self.depth))
        return out

    def _capture(self, rendered: list[Rendered]) -> list[Sample]:
        start = time.perf_counter()
        got = self.target.capture(rendered)
        self.capture_s += time.perf_counter() - start
        self.captures += 1 if getattr(self.target, "batched", False) else len(rendered)  # forwards or requests
        self.capture_tokens += sum(len(r.input_ids) for r in rendered)
        return got

    def get_many(self, indices: list[int], owned: list[bool] | None = None) -> list[Sample]:
        if self.drafter is None:
            raise RuntimeError("OnPolicySamples.start() gives the rollout drafter before any sample is asked for")
        distinct = list(dict.fromkeys(indices))
        ids = [self.base.rendered[i].conversation_id for i in distinct]
        start = time.perf_counter()
        if self.settings.temperature > 0:
            rollouts = self._sampled(distinct)
            fresh, reused = set(range(len(distinct))), set()  # every sampled rollout is new
            decode_s = time.perf_counter() - start
            samples = self._capture([Rendered(c, torch.tensor(r.tokens), r.loss_mask()) for c, r in zip(ids, rollouts)])
        else:
            plans = [self._plan(i) for i in distinct]
            reused, samples_of = self._reuse(distinct, ids, plans)
            missing = [k for k, i in enumerate(distinct) if i not in self._greedy]
            if missing or getattr(self.target, "batched", False):  # a batched target's ranks generate together
                got = self.target.generate([plans[k][0] for k in missing], [plans[k][1] for k in missing],
                                           self.stop_ids)
                for k, new in zip(missing, got):
                    self._greedy[distinct[k]] = torch.tensor(new, dtype=torch.int32)
            fresh = set(missing)
            generate_s = time.perf_counter() - start
            todo = [k for k in range(len(distinct)) if k not in samples_of]
            for k, sample in zip(todo, self._capture([self._rendered(ids[k], plans[k][0], distinct[k])
                                                      for k in todo])):
                samples_of[k] = sample
            samples = [samples_of[k] for k in range(len(distinct))]
            start = time.perf_counter()
            rollouts = self._replayed(distinct, samples)
            decode_s = generate_s + time.perf_counter() - start
        made = {}
        for k, (i, r, sample) in enumerate(zip(distinct, rollouts, samples)):
            steps = r.draft_steps()
            self._count(r, steps, decode_s / len(distinct), k in fresh, k in reused)
            made[i] = RolloutSample(**{f: getattr(sample, f) for f in sample.__dataclass_fields__}, draft_steps=steps)
        return [made[i] for i in indices]

    def _rendered(self, conversation_id: str, prompt: list[int], i: int) -> Rendered:
        """Sample i's greedy rollout as a sample to capture: its prompt and kept continuation, the latter masked."""
        new = self._greedy[i].tolist()
        mask = torch.zeros(len(prompt) + len(new), dtype=torch.bool)
        mask[len(prompt):] = True
        return Rendered(conversation_id, torch.tensor([*prompt, *new]), mask)

    def _reuse(self, distinct: list[int], ids: list[str], plans: list[tuple[list[int], int]]
               ) -> tuple[set[int], dict[int, Sample]]:
        """Where no text is kept yet for a sample, prep's reply is tried as its greedy rollout: captured (the capture
        the rollout needs anyway) and kept if the target's argmax gives it token by token (`_is_greedy`). A target
        whose ranks run their forwards together (zero3, tp) generates instead: every rank's calls stay in step.
        Returns the positions reused and their captured samples."""
        if getattr(self.target, "batched", False) or not self.settings.reuse_prep_replies:
            return set(), {}
        tried = {}
        for k, i in enumerate(distinct):
            if i not in self._greedy and plans[k][1] > 0 and (reply := self._prep_reply(i, plans[k][1])):
                tried[k] = reply
        if not tried:
            return set(), {}
        for k, reply in tried.items():
            self._greedy[distinct[k]] = torch.tensor(reply, dtype=torch.int32)
        got = self._capture([self._rendered(ids[k], plans[k][0], distinct[k]) for k in tried])
        kept = {}
        for k, sample in zip(tried, got):
            if self._is_greedy(sample, len(plans[k][0])):
                kept[k] = sample
            else:
                del self._greedy[distinct[k]]  # generated below, and captured again
        return set(kept), kept

    def __getitem__(self, i: int) -> Sample:
        return self.get_many([i])[0]

    def _count(self, r: Rollout, steps: Tensor, seconds: float, generated: bool, reused: bool = False) -> None:
        add = {"rollouts": 1, "rollouts_generated": int(generated), "rollouts_reused": int(reused),
               "rollout_new_tokens": r.new_tokens, "rollout_cycles": len(r.accept_lengths),
               "rollout_accepted": sum(r.accept_lengths), "replay_pairs": int(steps.sum()),
               "replay_rejected": len(r.rejected_positions()), "rollout_s": seconds}
        for k, v in add.items():
            self.counts[k] += v
            self.totals[k] += v

    def take_counts(self) -> Tensor:
        """This rank's counters since the last call (float64 [len(COUNTERS)]), reset: the trainer adds them over
        the ranks (then `window_metrics`)."""
        out = torch.tensor([self.counts[k] for k in COUNTERS], dtype=torch.float64)
        self.counts = dict.fromkeys(COUNTERS, 0.0)
        return out

    @staticmethod
    def window_metrics(counts: Tensor) -> dict:
        """metrics.jsonl's rollout_* / replay_* of a log window from the counters summed over the ranks."""
        got = dict(zip(COUNTERS, counts.double().cpu().tolist()))
        return {**{k: (int(v) if k != "rollout_s" else v) for k, v in got.items()}, **summary(got)}

    def run_totals(self) -> Tensor:
        """This rank's counters over the run (float64 [len(COUNTERS)]), for the trainer to add over the ranks."""
        return torch.tensor([self.totals[k] for k in COUNTERS], dtype=torch.float64)

    def set_run_totals(self, counts: Tensor) -> None:
        """The run's counters over every rank (the summary's), replacing this rank's."""
        self.totals = dict(zip(COUNTERS, counts.double().cpu().tolist()))

    def stats(self) -> dict:
        """What the summary says of the source: this rank's target captures of the rollouts (besides the rollouts'
        own generation or verify forwards, in rollout_s), the rollout counters (over every rank once the trainer has
        set them, `set_run_totals`) and their `summary`."""
        return {**self.target.stats(), "source": "on_policy", "target_forward_s": self.capture_s,
                "target_forward_tokens": self.capture_tokens, "target_forwards": self.captures, **self.totals,
                **summary(self.totals), "rollout_drafter_step": self.drafter_step}


def summary(counts: dict[str, float]) -> dict:
    """What the counters say (over the ranks): rollout_tau, the tokens each target verify gave (accepted drafts and
    the target's own token: the acceptance length τ of chain decoding with the rollout drafter, the prefill's token
    left out); rollout_accept_rate, the share of proposed drafts the target accepted; replay_pairs_per_token, the
    (anchor, step) pairs trained per new token; replay_rejected, the rejected proposals replayed."""
    cycles = max(counts["rollout_cycles"], 1.0)
    tokens = max(counts["rollout_new_tokens"], 1.0)
    return {"rollout_tau": (counts["rollout_accepted"] + counts["rollout_cycles"]) / cycles,
            "rollout_accept_rate": counts["rollout_accepted"] / max(counts["rollout_accepted"] + counts["replay_rejected"],
                                                                    1.0),
            "replay_pairs_per_token": counts["replay_pairs"] / tokens}


def on_policy_source(cfg, base) -> OnPolicySamples:
    """The train split's source of a run with train.on_policy.enabled: `base` (its OnlineSamples, or ServedSamples
    with data.source=vllm) rolled out against the target where `base` has it; the rollouts stop where the target's
    reply does (`stop_token_ids`: its generation config's and tokenizer's EOS, its chat template's end of turn)."""
    from data_prep.chat import stop_token_ids
    from train.served import ServedSamples

    if isinstance(base, ServedSamples):
        from types import SimpleNamespace

        from transformers import GenerationConfig

        from data_prep.targets import load_tokenizer, model_path, resolve_target

        source = base.rendered.target_source
        preset = resolve_target(cfg.data.target or source.model)
        try:
            generation = GenerationConfig.from_pretrained(model_path(preset))
        except OSError:  # no generation_config.json: the tokenizer's EOS and the template's end of turn
            generation = None
        stop = stop_token_ids(SimpleNamespace(generation_config=generation),
                              load_tokenizer(preset, source.chat_template))
        return OnPolicySamples(base, ServedTarget(base), cfg.train.on_policy, cfg.data.max_len, cfg.train.seed, stop)
    frozen = base.target
    stop = stop_token_ids(frozen.model, frozen.tokenizer) if frozen.tokenizer is not None else ()
    return OnPolicySamples(base, RankTarget(base), cfg.train.on_policy, cfg.data.max_len, cfg.train.seed, stop)
