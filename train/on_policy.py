"""train.on_policy (Draft-OPD): training on the drafter's own rollouts against the target, instead of on trajectories
the target wrote alone.

`OnPolicySamples` is a sample source (train/online.py's interface: train/data.py's sampler, cursor, collate and the
train loop are unchanged). Sample i is a rollout of prep's rendered sample i's first prompt (its tokens before the
first loss-masked one): the *rollout drafter* drafts chains of train.on_policy.depth tokens, the frozen target in this
rank verifies them (train/rollout.py: lossless, so the continuation is the target's), then one target forward over
prompt + continuation gives the taps and the exact teacher, as online training captures any sample. The sample
carries `draft_steps`, the (anchor, TTT step) pairs the rollout visited, so the TTT loss replays exactly that drafting
with the drafter being trained, against the target's distribution there: on the accepted proposals and at each
rejected one (train/ttt.py target_rows).

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
from train.config import OnPolicyConfig
from train.rollout import Rollout, rollout

ROLLOUT_PREFIX = "rollout/"  # the rollout drafter's tensors in a checkpoint's model.safetensors
# Per-step statistics (summed over the ranks between two log lines): metrics.jsonl's rollout_* and replay_*.
COUNTERS = ("rollouts", "rollout_new_tokens", "rollout_cycles", "rollout_accepted", "replay_pairs",
            "replay_rejected", "rollout_s")


@dataclass
class RolloutSample(Sample):
    """A shard sample of a rollout, with the TTT steps inference visited from each position (train/rollout.py)."""

    draft_steps: Tensor | None = None


def prompt_length(loss_mask: Tensor) -> int:
    """Tokens before the first loss-masked one: the first turn's prompt (0 when the sample has no loss token)."""
    hits = loss_mask.nonzero()
    return int(hits[0, 0]) if hits.numel() else 0


class OnPolicySamples:
    """The train split's prompts rolled out with the rollout drafter (see the module docstring). `online`: the
    split's OnlineSamples (its rendered samples and frozen target); `stop_ids`: the target's end-of-turn / EOS ids."""

    def __init__(self, online, settings: OnPolicyConfig, max_len: int, seed: int, stop_ids: tuple[int, ...]):
        self.online, self.settings, self.max_len, self.seed = online, settings, max_len, seed
        self.stop_ids = tuple(stop_ids)
        self._prompts = [prompt_length(online.rendered[i].loss_mask) for i in range(len(online))]
        self.drafter: nn.Module | None = None
        self.drafter_step = 0  # the optimizer step whose weights the rollout drafter holds
        self.counts = dict.fromkeys(COUNTERS, 0.0)
        self.totals = dict.fromkeys(COUNTERS, 0.0)
        self.captures, self.capture_tokens, self.capture_s = 0, 0, 0.0  # the target forwards over the rollouts

    def __str__(self) -> str:
        return f"{self.online.rendered.root} (on-policy rollouts of {self.online.rendered.spec.target.get('id')})"

    @property
    def manifest(self):
        return self.online.manifest

    def __len__(self) -> int:
        return len(self.online)

    def sample_ids(self) -> list[str]:
        return self.online.sample_ids()

    def lengths(self) -> list[int]:
        """Upper bounds (the sampler buckets by them): the prompt and max_new_tokens, cut at data.max_len."""
        return [min(p + self.settings.max_new_tokens, self.max_len) for p in self._prompts]

    # -- the rollout drafter --------------------------------------------------------------------------------------
    def start(self, drafter: nn.Module, device: torch.device, dtype: torch.dtype, step: int = 0,
              state: dict[str, Tensor] | None = None) -> None:
        """The rollout drafter: a frozen copy of `drafter` (before the engine takes it) on this rank's device, with
        the weights of `state` (a checkpoint's, `state()`) where a run resumes."""
        self.drafter = copy.deepcopy(drafter).to(device=device, dtype=dtype).eval().requires_grad_(False)
        if state:
            self._load(state, step)
        self.drafter_step = step

    def _load(self, params: dict[str, Tensor], step: int) -> None:
        own = self.drafter.state_dict()
        unknown = sorted(set(params) - set(own))
        if unknown:
            raise KeyError(f"rollout drafter weights {unknown[:4]} are not the drafter's")
        with torch.no_grad():
            for name, value in params.items():
                own[name].copy_(value.to(own[name].dtype))
        self.drafter_step = step

    def refresh(self, params: dict[str, Tensor], step: int) -> None:
        """The trained weights (Engine.full_params(all_ranks=True), full fp32) into the rollout drafter."""
        self._load(params, step)

    def state(self) -> dict[str, Tensor]:
        """The rollout drafter's trained tensors for a checkpoint (the target's frozen ones are the prep's)."""
        trained = {n for n, p in self.drafter.named_parameters()}
        from models.registry import family_of_drafter

        frozen = set(family_of_drafter(self.drafter).frozen_keys)
        return {n: t.detach().float().cpu().clone() for n, t in self.drafter.state_dict().items()
                if n in trained and n not in frozen}

    # -- samples --------------------------------------------------------------------------------------------------
    def _generator(self, sample_id: str) -> torch.Generator | None:
        if self.settings.temperature <= 0:
            return None
        digest = hashlib.sha256(f"{self.seed}/{sample_id}/{self.drafter_step}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))

    def _rollout(self, i: int) -> Rollout:
        from models.registry import family_of_drafter

        if self.drafter is None:
            raise RuntimeError("OnPolicySamples.start() gives the rollout drafter before any sample is asked for")
        rendered = self.online.rendered[i]
        prompt = rendered.input_ids[: self._prompts[i]].tolist()
        budget = min(self.settings.max_new_tokens, self.max_len - len(prompt))
        if not prompt or budget < 1:  # nothing to roll out within data.max_len: a sample without a loss row
            tokens = (prompt or rendered.input_ids[:1].tolist())[: self.max_len]
            return Rollout(len(tokens), tokens, [], self.settings.depth)
        generate = functools.partial(family_of_drafter(self.drafter).rollout_fn, self.online.target.model,
                                     self.drafter, depth=self.settings.depth,
                                     temperature=self.settings.temperature, eos_token_ids=self.stop_ids,
                                     generator=self._generator(rendered.conversation_id))
        return rollout(lambda ids, n: generate(ids, n), prompt, budget, self.settings.depth)

    def get_many(self, indices: list[int], owned: list[bool] | None = None) -> list[Sample]:
        distinct = list(dict.fromkeys(indices))
        made: dict[int, Sample] = {}
        for i in distinct:
            start = time.perf_counter()
            r = self._rollout(i)
            self._count(r, time.perf_counter() - start)
            start = time.perf_counter()
            rendered = Rendered(self.online.rendered[i].conversation_id, torch.tensor(r.tokens), r.loss_mask())
            (captured,) = self.online.target.samples([rendered])
            self.capture_s += time.perf_counter() - start
            self.captures, self.capture_tokens = self.captures + 1, self.capture_tokens + len(r.tokens)
            plain = as_read_back(captured, self.manifest)
            made[i] = RolloutSample(**{f: getattr(plain, f) for f in plain.__dataclass_fields__},
                                    draft_steps=r.draft_steps())
        return [made[i] for i in indices]

    def __getitem__(self, i: int) -> Sample:
        return self.get_many([i])[0]

    def _count(self, r: Rollout, seconds: float) -> None:
        steps = r.draft_steps()
        add = {"rollouts": 1, "rollout_new_tokens": r.new_tokens, "rollout_cycles": len(r.accept_lengths),
               "rollout_accepted": sum(r.accept_lengths), "replay_pairs": int(steps.sum()),
               "replay_rejected": len(r.rejected_positions()), "rollout_s": seconds}
        for k, v in add.items():
            self.counts[k] += v
            self.totals[k] += v

    def take_counts(self) -> Tensor:
        """This rank's counters since the last call (float64 [len(COUNTERS)]), reset: the trainer adds them over
        the ranks (`step_metrics`)."""
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
        """What the summary says of the source: this rank's target forwards that captured the rollouts' features
        (besides the rollouts' own verify forwards, in rollout_s), the rollout counters (over every rank once the
        trainer has set them, `set_run_totals`) and their `summary`."""
        return {**self.online.stats(), "source": "on_policy", "target_forward_s": self.capture_s,
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


def on_policy_source(cfg, online) -> OnPolicySamples:
    """The train split's source of a run with train.on_policy.enabled: `online` (its OnlineSamples) rolled out; the
    rollouts stop where the target's reply does (`stop_token_ids`)."""
    from data_prep.chat import stop_token_ids

    target = online.target
    stop = stop_token_ids(target.model, target.tokenizer) if target.tokenizer is not None else ()
    return OnPolicySamples(online, cfg.train.on_policy, cfg.data.max_len, cfg.train.seed, stop)
