"""End-to-end evaluation: load target + exported drafter, decode prompts speculatively and plainly, report.

Every generated turn is one "request" (τ per request, samples). Speedup = tokens/s of speculative
decoding / tokens/s of plain decoding, same target, prompts, max_new_tokens, machine and run
(docs/method.md §6). The verify budget m (total_tokens) is reported next to it.

Before the target loads: the prompts, the export's config.json and the model it records (`check_target_id`), and
with engine=vllm the vLLM install (its python imports vLLM: `engine_ready`); before anything decodes, the export's
weights (readable, finite) and the target's shape and tokenizer against its record. Every one of these stops as a
user error naming the file or both targets. The target and drafter live only while our evaluator decodes
(`evaluate_ours`): with engine=vllm they are released before vLLM's first server starts on the same device
(eval/engine.py).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from data_prep.chat import stop_token_ids
from eval import metrics
from eval.budget import (
    AdaptiveBudget,
    CycleCost,
    CycleOverhead,
    ForwardTimer,
    Timer,
    TreeProbe,
    VerifyCost,
    choose_total_tokens,
    decode_context_len,
    interleaved_costs,
)
from eval.categories import (
    CI_DEFINITION,
    MIN_CI_PROMPTS,
    acceptance_of,
    category_entries,
    groups,
    report_markdown,
    suite_entries,
)
from eval.config import WARMUP_TOKENS, EvalConfig
from eval.prompts import load_prompts, render
from eval.sampling import SamplingParams
from eval.spec_decode import (
    NEAR_TIE_RTOL,
    GenerationRecord,
    SpecSettings,
    SpeculativeDecoder,
    first_difference,
    plain_generate,
)
from eval.target import TargetRunner
from infra.config_keys import ConfigError
from infra.strict_json import dumps
from models.export import CONFIG_FILE, TARGET_KEY, ExportError, read_export, unreadable_weights
from models.registry import DrafterFamily, family, family_of_drafter

REPORT_FILE = "report.json"
CATEGORIES_FILE = "categories.md"


def load_drafter(export_dir: str, target_model, device: str, dtype: torch.dtype, tokenizer=None,
                 target_name: str = "the target"):
    """Any family's export (models/registry.py), with the target's frozen tensors (embedding, LM head). An export
    that records another target than this one (its tokenizer too, when given), or tap layers other than those its
    config.json now names, is refused naming both (models.export.check_target)."""
    from eval.target import target_fingerprint
    from models.export import check_tap_layers, check_target
    from models.registry import family_of_export
    from models.target_head import EMBED_KEY, LM_HEAD_KEY, scaled_embedding_weight

    raw = read_export(export_dir)
    actual = target_fingerprint(target_model.config.to_dict(), tokenizer, target_name)
    check_target(raw.get(TARGET_KEY), actual, f"drafter {export_dir}", f"target {target_name}")
    embed = scaled_embedding_weight(target_model)  # as the target embeds (Gemma: times sqrt(hidden))
    text_cfg = target_model.config.get_text_config()
    head = target_model.get_output_embeddings()
    weights = {EMBED_KEY: embed.detach().cpu()}
    if head is not None:
        weights[LM_HEAD_KEY] = head.weight.detach().cpu()
    try:
        with unreadable_weights(export_dir):
            drafter = family_of_export(raw).load_export(
                export_dir, target_weights=weights, target_num_layers=int(text_cfg.num_hidden_layers), dtype=dtype
            )
    except ExportError:
        raise
    except ValueError as e:  # the export's config.json or tensors do not make a drafter for this target
        raise ExportError(f"drafter {export_dir} on target {target_name}: {e}") from e
    drafter = drafter.to(device=device).eval().requires_grad_(False)
    check_tap_layers(raw.get(TARGET_KEY), drafter.tap_layers, f"drafter {export_dir}")
    if drafter.cfg.vocab_size != embed.shape[0]:
        raise ExportError(f"drafter {export_dir}: vocab_size {drafter.cfg.vocab_size} != target {target_name}'s "
                          f"vocabulary {embed.shape[0]}: the drafter was trained for another target")
    tgt_h = getattr(drafter.cfg, "target_hidden_size", None) or drafter.cfg.hidden_size
    if tgt_h != text_cfg.hidden_size:
        raise ExportError(f"drafter {export_dir} expects target hidden size {tgt_h}, target {target_name} has "
                          f"{text_cfg.hidden_size}")
    return drafter


def read_export_weights(export_dir: str) -> dict:
    """The export's tensors (models.export.read_weights: every one checked finite), a damaged file an ExportError."""
    from models.export import read_weights

    with unreadable_weights(export_dir):
        return read_weights(Path(export_dir))


def _local_path(ref: str) -> bool:
    return ref.startswith(("/", ".", "~")) or Path(ref).expanduser().is_dir()


def check_target_id(raw: dict, preset, drafter: str) -> None:
    """ExportError naming both when the export records (`TARGET_KEY` `id`, prep's hub id of the target) another
    model than the target evaluated (a preset's name or hub id, or a hub id; case aside): the same shape and
    tokenizer do not make the same model, whose hidden states the drafter reads. A local directory on either side
    is a copy of any model: its shape and tokenizer are compared (models.export.check_target), not its name."""
    recorded = (raw.get(TARGET_KEY) or {}).get("id")
    if not isinstance(recorded, str) or not recorded or preset.local_path or _local_path(recorded):
        return
    if recorded.lower() in {preset.name.lower(), preset.hf_id.lower()}:
        return
    named = preset.name if preset.name == preset.hf_id else f"{preset.name} ({preset.hf_id})"
    raise ExportError(f"drafter {drafter} was trained for target {recorded}, not for target {named}: a model of the "
                      "same shape is still another model, whose hidden states the drafter never saw; evaluate with "
                      f"target={recorded} (or a local copy of it: a directory is compared by shape and tokenizer)")


def check_export(drafter: str, preset, tokenizer) -> str:
    """Before vLLM starts (eval/engine.py): an export that cannot be read, with non-finite weights, of a family vLLM
    does not serve, or trained for another target, stops with its reason (ExportError), as `load_drafter` refuses
    it. Returns vLLM's speculative method for it (the family table's)."""
    from data_prep.targets import load_target_config
    from eval.target import target_fingerprint
    from models.export import check_tap_layers, check_target
    from models.registry import FAMILIES, family_of_export

    raw = read_export(drafter)
    check_target_id(raw, preset, drafter)
    read_export_weights(drafter)
    try:
        fam = family_of_export(raw)
    except ValueError as e:
        raise ExportError(f"drafter {drafter}: {e}") from None
    if fam.vllm_method is None:
        served = [f.label for f in FAMILIES.values() if f.vllm_method]
        raise ExportError(f"drafter {drafter} is a {fam.label} export; vLLM serves {served} drafters")
    actual = target_fingerprint(load_target_config(preset), tokenizer, preset.name)
    check_target(raw.get(TARGET_KEY), actual, f"drafter {drafter}", f"target {preset.name}")
    try:  # the layer ids vLLM will tap: in range for this target, and the ones the drafter was trained on
        cfg = fam.config_cls.from_hf_dict(raw, target_num_layers=actual["num_layers"])
    except ValueError as e:  # a config.json vLLM's loader cannot take either
        raise ExportError(f"drafter {drafter}: {e}") from None
    check_tap_layers(raw.get(TARGET_KEY), cfg.tap_layers, f"drafter {drafter}")
    return fam.vllm_method


def engine_ready(python: str | None) -> tuple[str, dict]:
    """engine=vllm: the python of vLLM and its check (serving.server.ready with prep's check module: vLLM
    imported, new enough, `version`, `cuda`), before anything loads; VLLMUnavailable, a user error, otherwise."""
    from serving.client import VLLM_PLUGIN
    from serving.server import VLLMUnavailable, ready

    try:
        return ready(python, VLLM_PLUGIN)
    except VLLMUnavailable as e:
        raise VLLMUnavailable(f"engine=vllm: {e}") from None


def release_device(device: str) -> None:
    """Our evaluator's target and drafter, gone with `evaluate_ours`'s frame, returned to the device: collected, and
    the CUDA allocator's cached blocks freed, so vLLM's server can take that memory."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_eval(cfg: EvalConfig, progress: bool = True, timer: Timer | None = None) -> dict:
    """The evaluation of `cfg` (module docstring) -> the report, also written to cfg.out_dir. `timer` replaces the
    target's timed forwards behind decode.auto_total_tokens (eval/budget.py Timer); None: the real ones."""
    from data_prep.targets import resolve_target

    cfg.validate()
    d = cfg.decode
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    # before the target loads: the prompts, the export's config and recorded target, vLLM
    records_in = load_prompts(cfg.prompts, per_category=d.num_prompts if d.num_prompts > 0 else None,
                              max_turns=d.max_turns if d.max_turns > 0 else None)
    preset = resolve_target(cfg.target)
    if (Path(cfg.drafter) / CONFIG_FILE).is_file():  # an export without one is named where the drafter loads
        check_target_id(read_export(cfg.drafter), preset, cfg.drafter)
    vllm = engine_ready(cfg.vllm.python) if cfg.engine == "vllm" else None
    report, samples, cost, session = evaluate_ours(cfg, preset, records_in, vllm, progress, timer)
    if session is not None:  # the target and drafter are released: the engine takes the device
        release_device(report["device"])
        add_engine(report, session, samples, d, report["stop_token_ids"], cost, progress)
    report["samples"] = samples
    write_report(report, Path(cfg.out_dir), cfg.plots)
    return report


def evaluate_ours(cfg: EvalConfig, preset, records_in, vllm: tuple[str, dict] | None, progress: bool,
                  timer: Timer | None = None):
    """Our evaluator: the target and drafter loaded, the engine's session prepared (`vllm`: its python and check;
    the export checked as vLLM loads it, the prompts' lengths), every prompt decoded -> (report without samples,
    samples, the cycle cost, the engine session or None). The target and drafter are not returned: they go with
    this frame."""
    from data_prep.targets import load_target, model_path

    d = cfg.decode
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_target(preset, dtype=cfg.dtype, device=device, chat_template=cfg.chat_template)
    drafter = load_drafter(cfg.drafter, model, device, next(model.parameters()).dtype, tokenizer, preset.name)
    template_kwargs = {} if preset.enable_thinking is None else {"enable_thinking": preset.enable_thinking}
    session = None
    if vllm is not None:  # before decoding: the export as vLLM loads it, the lengths
        session = engine_session(cfg, vllm, preset, tokenizer, model)
        check_engine_lengths(records_in, tokenizer, template_kwargs, d.max_new_tokens, cfg.vllm.max_model_len)
    runner = TargetRunner(model, drafter.tap_layers)
    eos = stop_token_ids(model, tokenizer, template_kwargs)
    params = SamplingParams(d.temperature, d.top_p, d.top_k)

    probe = None
    if d.mode == "tree" and d.auto_total_tokens:
        probe = TotalTokensProbe(records_in, tokenizer, template_kwargs, params, eos, timer)
    decoder, budget, (total_tokens, timings, choice) = build_decoder(d, runner, drafter, progress, probe)

    if cfg.warmup:  # first calls pay one-off allocation / kernel selection costs
        ids = render(tokenizer, records_in[0].messages(0, []), template_kwargs)
        decoder.generate(ids, min(WARMUP_TOKENS, d.max_new_tokens), params, eos, torch.Generator().manual_seed(0))
        if cfg.baseline:
            plain_generate(runner, ids, min(WARMUP_TOKENS, d.max_new_tokens), params, eos,
                           torch.Generator().manual_seed(0))
        if budget is not None:
            budget.log.clear()  # its learned rates stay; the report covers the timed prompts only

    spec_recs, base_recs, peer, samples = decode_prompts(cfg, records_in, decoder, runner, model, tokenizer,
                                                         template_kwargs, params, eos, progress)
    summary = metrics.summarize(spec_recs, decoder.depth)
    # a drafter over the target's whole vocabulary (no draft vocabulary: models/registry.py) never misses a token
    t2d = drafter.t2d if family_of_drafter(drafter).draft_vocab else None
    summary["oov_rate"] = metrics.oov_rate(spec_recs, t2d) if t2d is not None else 0.0
    summary["tau_ci95"] = acceptance_of(samples, spec_recs, range(len(samples)), decoder.depth)["tau_ci95"]
    entries = category_entries(samples, spec_recs, base_recs, t2d, decoder.depth)
    block = (total_tokens if d.mode == "tree" else decoder.strategy.depth) + 1  # tokens a verify forward takes
    cost = CycleCost.measure(runner, [block, *[c * x for c in cfg.vllm.concurrency for x in (1, d.depth + 1)]],
                             spec_recs)
    for e in entries:
        e["speedup_predicted"] = cost.predicted_speedup(e["tau"], block)
    spec_rate = metrics.tokens_per_s(spec_recs)
    base_rate = metrics.tokens_per_s(base_recs)
    report = {
        "target": preset.name,
        "target_path": model_path(preset),
        "drafter": cfg.drafter,
        "prompts": cfg.prompts,
        "num_prompts": len(records_in),
        "num_requests": len(spec_recs),
        "stop_token_ids": list(eos),
        "device": device,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "decode": {**asdict(d), "total_tokens": total_tokens, "total_tokens_timings_s": timings,
                   "total_tokens_choice": choice.to_dict() if choice is not None else None},
        # what the drafter really did: a DFlash drafter drafts its block (block_size) whatever decode.depth says
        "drafting": decoder.strategy.describe(),
        "tau_definition": "(accepted drafts + 1 bonus) per verify forward; prefill and budget cut excluded",
        "tau_ci95_definition": CI_DEFINITION,
        "oov_rate_definition": "share of emitted tokens outside the draft vocabulary (never proposable)",
        **summary,
        "tokens_per_s": {"speculative": spec_rate, "baseline": base_rate},
        "speedup": spec_rate / base_rate if base_recs else None,
        "speedup_predicted": cost.predicted_speedup(summary["tau_pooled"], block),
        "cycle_cost": {**cost.to_dict(), "verified_tokens": block},
        "suites": suite_entries(samples, spec_recs, decoder.depth),
        "categories": entries,
    }
    add_comparisons(report, cfg, budget, spec_recs, base_recs, peer, params, base_rate)
    return report, samples, cost, session


def engine_session(cfg: EvalConfig, vllm: tuple[str, dict], preset, tokenizer, model):
    """The engine's servers (eval/engine.py) with `vllm` (`engine_ready`'s python and check) and the export checked
    as vLLM will load it, before any decoding."""
    from data_prep.targets import model_path
    from eval.engine import EngineSession

    method = check_export(cfg.drafter, preset, tokenizer)
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return EngineSession(cfg.vllm, *vllm, model_path(preset), dtype, cfg.drafter, method,
                         Path(cfg.out_dir) / "engine", warmup=cfg.warmup)


def check_engine_lengths(records, tokenizer, template_kwargs: dict, max_new_tokens: int, max_model_len: int) -> None:
    """A prompt whose last turn cannot fit the engine's context (its turns, and max_new_tokens for each answer)
    stops the evaluation before anything is decoded, naming it, rather than failing in the engine afterwards."""
    for r in records:
        last = len(r.turns) - 1
        need = len(render(tokenizer, r.messages(last, [""] * last), template_kwargs)) + max_new_tokens * len(r.turns)
        if need > max_model_len:  # a setting the prompts outgrow: the user's to change (launch/errors.py)
            raise ConfigError(f"prompt {r.suite}/{r.id} ({r.category}) needs up to {need} tokens with its answers, "
                              f"more than vllm.max_model_len={max_model_len}: raise it or lower decode.max_new_tokens")


def add_engine(report: dict, session, samples: list[dict], d, eos, cost: CycleCost, progress: bool) -> None:
    """The same turns through vLLM (eval/engine.py), sampled as ours (every parameter stated): each category's
    `engine` entry beside ours, the pooled engine figures, the draft-settings sweep, the load sweep, and how the
    engine ran (mode, sampling, warm-up, device memory)."""
    from eval import engine
    from eval.categories import tau_outside_interval

    g = groups(samples)
    turns = {key: [samples[i]["prompt_token_ids"] for i in idx] for key, idx in g.items()}
    first = [s["prompt_token_ids"] for s in samples if s["turn"] == 0]
    sampled = engine.sampling(d.temperature, d.top_p, d.top_k, d.seed)
    body = {"max_tokens": d.max_new_tokens, **sampled, "stop_token_ids": list(eos), "skip_special_tokens": False}
    k = d.depth
    res = engine.evaluate(session, turns, first, body, k, progress)
    stops = set(eos)

    def same(a: list[list[int]], b: list[list[int]]) -> dict:
        trim = [[x[:-1] if x and x[-1] in stops else x for x in side] for side in (a, b)]  # a stop id or not
        return {"count": sum(x == y for x, y in zip(*trim)), "of": len(a)}

    drafts = accepted = 0
    for e in report["categories"]:
        key = (e["suite"], e["category"])
        spec, plain = res["categories"][k][key], res["categories"][0][key]
        drafts, accepted = drafts + spec["drafts"], accepted + spec["accepted"]
        settings = {str(kk): {"tau": r[key].get("tau"), "tokens_per_s": r[key]["tokens_per_s"]}
                    for kk, r in res["categories"].items()}
        e["engine"] = {
            "tau": spec["tau"], "alpha": spec["alpha"], "drafts": spec["drafts"],
            "tokens_per_s": {"speculative": spec["tokens_per_s"], "baseline": plain["tokens_per_s"]},
            "speedup": (spec["tokens_per_s"] / plain["tokens_per_s"]
                        if spec["tokens_per_s"] and plain["tokens_per_s"] else None),
            "identical_to_plain": same(spec["outputs"], plain["outputs"]),
            "identical_to_ours": same(spec["outputs"], [samples[i]["output_token_ids"] for i in g[key]]),
            "settings": settings,
            "best_num_speculative_tokens": int(max(settings, key=lambda x: settings[x]["tokens_per_s"] or 0.0)),
        }
        e["engine"]["tau_outside_ci"] = tau_outside_interval(e)
    load = []
    for plain, spec in zip(res["load"].get(0, []), res["load"].get(k, [])):
        load.append({"concurrency": plain["concurrency"], "plain": plain, "speculative": spec,
                     "speedup": spec["output_tokens_per_s"] / plain["output_tokens_per_s"],
                     "speedup_predicted": cost.predicted_speedup(spec["tau"], k + 1, plain["concurrency"],
                                                                   drafting=False)})
    report["engine"] = {
        "name": "vllm", "version": session.version, "method": session.method, "num_speculative_tokens": k,
        "python": session.python,
        "mode": {"enforce_eager": session.eager, "reason": session.eager_reason},
        # both sides: ours decodes with temperature / top-p / top-k (eval/sampling.py) and nothing else
        "sampling": sampled, "generation_config": "vllm",
        "warmup": {"requests_per_server": 1, "max_tokens": min(WARMUP_TOKENS, d.max_new_tokens)} if session.warmup
        else None,
        # the share each server took of the device (None: no CUDA device); our target and drafter were released
        "device_memory": session.memory,
        "tau": 1 + accepted / drafts if drafts else None,
        "num_speculative_tokens_swept": [int(x) for x in res["categories"]],
        "load": load,
        "definition": "τ = 1 + accepted / drafts from vLLM's spec_decode counters; α_n conditional as ours; tokens/s "
                      "= output tokens / the requests' wall time, one request at a time (load: c in flight, "
                      "ignore_eos, tokens / the level's wall time; TTFT: time to the first token; TPOT: time per "
                      "output token after the first, (last token's arrival − first token's) / (tokens − 1) per "
                      "request); identical: token ids equal, a final stop id aside; tau_outside_ci null: no interval "
                      f"(fewer than {MIN_CI_PROMPTS} prompts), not judged",
    }


class TotalTokensProbe:
    """What decode.auto_total_tokens measures its choice on: the first turns of the evaluated prompts (decoded once
    with the largest candidate tree before the timed decoding), the context their verifies will see, and the timer
    of the target's forwards at that context (`timer` replaces it: a scripted cost table)."""

    PROMPTS = 4  # at most this many first turns ...
    CYCLES = 64  # ... until this many cycles have shown the drafter's acceptance

    def __init__(self, records_in, tokenizer, template_kwargs: dict, params: SamplingParams, eos,
                 timer: Timer | None = None) -> None:
        self.records_in, self.tokenizer, self.template_kwargs = records_in, tokenizer, template_kwargs
        self.prompts = [render(tokenizer, r.messages(0, []), template_kwargs) for r in records_in[:self.PROMPTS]]
        self.params, self.eos, self.timer = params, eos, timer

    def context_len(self, max_new_tokens: int, max_positions: int | None, largest_block: int) -> int:
        """decode_context_len over every turn to be decoded; a later turn's prompt holds the earlier answers, not
        known before decoding, so each is counted at its most (max_new_tokens)."""
        lens = [len(render(self.tokenizer, r.messages(t, [""] * t), self.template_kwargs)) + t * max_new_tokens
                for r in self.records_in for t in range(len(r.turns))]
        ctx = decode_context_len(lens, max_new_tokens)
        return min(ctx, max_positions - largest_block) if max_positions else ctx

    def choose(self, d, runner: TargetRunner, drafter, progress: bool):
        """The choice (eval/budget.py choose_total_tokens): the acceptance of every candidate from the probe's
        cycles at the largest, our decoder's overhead on them, the forwards timed round-robin at the context."""
        largest = max(d.total_tokens_candidates)
        decoder = SpeculativeDecoder(runner, drafter, SpecSettings("tree", d.depth, d.topk, largest, d.sample_drafts))
        tree = TreeProbe(largest=largest)
        # the first cycles pay one-off costs (allocator, kernel choice) that would count as overhead
        decoder.generate(self.prompts[0], min(WARMUP_TOKENS, d.max_new_tokens), self.params, self.eos,
                         torch.Generator().manual_seed(d.seed))
        decoder.on_cycle = tree.record
        records = []
        for ids in self.prompts:
            records.append(decoder.generate(ids, d.max_new_tokens, self.params, self.eos,
                                            torch.Generator().manual_seed(d.seed)))
            if tree.cycles >= self.CYCLES:
                break
        overhead = CycleOverhead.from_records(records, d.depth, largest)
        max_positions = getattr(runner.model.config.get_text_config(), "max_position_embeddings", None)
        ctx = self.context_len(d.max_new_tokens, max_positions, largest + 1)
        timer = self.timer or ForwardTimer(runner, ctx)
        costs = interleaved_costs(timer, d.total_tokens_candidates)
        choice = choose_total_tokens(costs, tree.tau, overhead, ctx,
                                     probe={"m": largest, "prompts": len(records), "cycles": tree.cycles,
                                            "overhead_s": {"draft": overhead.draft_s, "other": overhead.other_s}})
        for row in choice.candidates:
            row["alpha"] = tree.alpha(row["m"], d.depth) if row["m"] else []
        if progress:
            print(f"auto total_tokens: {choice.reason}", flush=True)
        return choice


class PlainDecoder:
    """decode.auto_total_tokens chose m = 0: no candidate tree is predicted to pay, so the speculative side decodes
    as it would be deployed, plainly (the drafter unused); its τ is null, its speedup about 1."""

    def __init__(self, runner: TargetRunner, depth: int) -> None:
        self.runner, self.depth = runner, depth
        self.strategy = self  # the report asks the strategy how it drafted

    def describe(self) -> dict:
        return {"mode": "plain", "total_tokens": 0}

    def generate(self, prompt_ids, max_new_tokens, params, eos_token_ids=(), generator=None) -> GenerationRecord:
        return plain_generate(self.runner, prompt_ids, max_new_tokens, params, eos_token_ids, generator)


def build_decoder(d, runner, drafter, progress: bool, probe: TotalTokensProbe | None = None):
    """The speculative decoder of `decode.*`: its verify budget (the tree's total tokens, chosen by `probe` when
    decode.auto_total_tokens) and adaptive budget -> (decoder, adaptive budget or None, (total tokens, the timings
    behind the choice, the choice))."""
    total_tokens, timings, choice = d.total_tokens, None, None
    if probe is not None:
        choice = probe.choose(d, runner, drafter, progress)
        total_tokens, timings = choice.chosen, choice.timings
        if total_tokens == 0:
            return PlainDecoder(runner, d.depth), None, (total_tokens, timings, choice)
    settings = SpecSettings(d.mode, d.depth, d.topk, total_tokens, d.sample_drafts)
    budget = None
    if d.budget == "adaptive":
        most = total_tokens if d.mode == "tree" else d.depth
        budget = AdaptiveBudget(VerifyCost.measure(runner, most + 1))
    return SpeculativeDecoder(runner, drafter, settings, budget), budget, (total_tokens, timings, choice)


def decode_prompts(cfg: EvalConfig, records_in, decoder, runner, model, tokenizer, template_kwargs: dict, params,
                   eos, progress: bool):
    """Every turn of every prompt, speculatively (and plainly with cfg.baseline, by transformers' prompt lookup with
    cfg.prompt_lookup), each later turn following the model's own answer (MT-bench's protocol) -> (speculative
    records, plain records, prompt-lookup totals, per-turn samples)."""
    from tqdm import tqdm

    d = cfg.decode
    spec_recs: list[GenerationRecord] = []
    base_recs: list[GenerationRecord] = []
    peer = {"tokens": 0, "seconds": 0.0, "hf_tokens": 0, "hf_seconds": 0.0}
    samples: list[dict] = []
    bar = tqdm(records_in, desc=f"eval {d.mode}", unit="prompt", disable=not progress)
    for rec in bar:
        answers: list[str] = []  # the model's own, which each later turn follows
        for turn_idx in range(len(rec.turns)):
            ids = render(tokenizer, rec.messages(turn_idx, answers), template_kwargs)
            seed = d.seed + len(samples)
            spec = decoder.generate(ids, d.max_new_tokens, params, eos, torch.Generator().manual_seed(seed))
            spec_recs.append(spec)
            text = tokenizer.decode(spec.output_ids, skip_special_tokens=True)
            sample = {"id": rec.id, "suite": rec.suite, "category": rec.category or "all", "turn": turn_idx,
                      "prompt_token_ids": ids, "output_token_ids": spec.output_ids,
                      "output_text": text, "tau": metrics.tau_of(spec.accept_lengths)}
            if cfg.baseline:
                base = plain_generate(runner, ids, d.max_new_tokens, params, eos, torch.Generator().manual_seed(seed))
                base_recs.append(base)
                sample["baseline_output_token_ids"] = base.output_ids
                sample["baseline_output_text"] = tokenizer.decode(base.output_ids, skip_special_tokens=True)
            if cfg.prompt_lookup:
                from eval.peers import hf_generate

                out, sec = hf_generate(model, ids, d.max_new_tokens, params, eos, cfg.prompt_lookup_num_tokens, seed)
                peer["tokens"] += len(out)
                peer["seconds"] += sec
                out, sec = hf_generate(model, ids, d.max_new_tokens, params, eos, None, seed)
                peer["hf_tokens"] += len(out)
                peer["hf_seconds"] += sec
            samples.append(sample)
            answers.append(text)  # the next turn follows the model's own answer (MT-bench's protocol)
        bar.set_postfix(tau=f"{metrics.tau_pooled(spec_recs):.2f}")

    return spec_recs, base_recs, peer, samples


def add_comparisons(report: dict, cfg: EvalConfig, budget, spec_recs, base_recs, peer: dict, params,
                    base_rate: float) -> None:
    """The report's comparisons: the adaptive budget's forecast, outputs against plain decoding, prompt lookup."""
    if budget is not None:
        # The cost model's own forecast beside what happened (speedups: over its 1-token verify time, and measured).
        model = budget.summary()
        report["adaptive_budget"] = {
            **model,
            "speedup_predicted": model["tokens_per_s_predicted"] / model["plain_tokens_per_s_predicted"],
            "verify_cost_s": budget.verify.seconds,
            "definition": "per cycle m = argmax (1 + c·V_m) − r·(overhead + verify(m + 1)); V_m = Σ of the best m "
                          "path probabilities, c = accepted / predicted so far, r = tokens/s so far",
        }
    if base_recs:
        parted = [first_difference(s.output_ids, b) for s, b in zip(spec_recs, base_recs)]
        exact = report["dtype"] in ("float32", "float64")
        report["outputs_identical_to_baseline"] = {
            "count": parted.count(None), "of": len(base_recs),
            "expected_all": params.greedy and exact,  # T > 0 draws other streams; bf16 rounds (NEAR_TIE_RTOL)
            # bf16: outputs that first part from plain decoding where its top-2 logits are within NEAR_TIE_RTOL
            "parted_at_near_ties": sum(p is not None and p[1] is not None and p[1] <= NEAR_TIE_RTOL for p in parted),
            "near_tie_rtol": NEAR_TIE_RTOL,
            "expected_identical_or_near_tie": params.greedy and not exact,
        }
    if cfg.prompt_lookup:
        pl_rate = peer["tokens"] / peer["seconds"] if peer["seconds"] else float("nan")
        hf_rate = peer["hf_tokens"] / peer["hf_seconds"] if peer["hf_seconds"] else float("nan")
        report["prompt_lookup"] = {
            "num_tokens": cfg.prompt_lookup_num_tokens,
            "tokens_per_s": pl_rate,
            "speedup": pl_rate / base_rate if base_recs else None,
            "hf_generate_plain_tokens_per_s": hf_rate,
            "speedup_vs_hf_generate_plain": pl_rate / hf_rate,
        }


def write_report(report: dict, out_dir: Path, plots: bool = True) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / REPORT_FILE
    path.write_text(dumps(report, indent=1))
    if "categories" in report:
        (out_dir / CATEGORIES_FILE).write_text(report_markdown(report))
    if plots:
        from eval.plots import plot_accept_histogram, plot_categories, plot_per_position

        if "categories" in report:
            plot_categories(report, out_dir / "categories.png")

        label = _drafting_label(report)
        plot_per_position(report["per_position_acceptance"], out_dir / "per_position_acceptance.png", label)
        plot_accept_histogram(report["accept_length_histogram"], out_dir / "accept_length_histogram.png",
                              f"{label}  τ={report['tau_pooled']:.2f}")
    return path


def _drafting_family(report: dict) -> DrafterFamily | None:
    """The family that drafted (the report's "drafting" entry; None in a report without one)."""
    how = report.get("drafting") or {}
    return family(how["method"]) if "method" in how else None


def _drafting_label(report: dict) -> str:
    d, how, fam = report["decode"], report.get("drafting") or {}, _drafting_family(report)
    if fam is not None and fam.block_drafting:
        return f"{fam.label} block={how['block_size']} T={d['temperature']}"
    name = f"{fam.label} " if fam is not None else ""
    return f"{name}{d['mode']} depth={d['depth']} m={d['total_tokens']} T={d['temperature']}"


def _fmt(value: float | None, spec: str) -> str:
    """A metric of a report read back from its JSON, where an undefined one is null."""
    return "n/a" if value is None else format(value, spec)


def format_summary(report: dict) -> str:
    d = report["decode"]
    tps = report["tokens_per_s"]
    how, fam = report.get("drafting") or {}, _drafting_family(report)
    if fam is not None and fam.block_drafting:
        budget = f"block={how['block_size']}"
        decode = (f"decode: {fam.method} block_size={how['block_size']} ({how['draft_tokens_per_step']} drafts per "
                  f"verify; decode.depth/topk/total_tokens unused) T={d['temperature']} "
                  f"max_new_tokens={d['max_new_tokens']}")
    else:
        budget = f"m={d['total_tokens']}"
        decode = (f"decode: mode={d['mode']} depth={d['depth']} topk={d['topk']} total_tokens(m)={d['total_tokens']} "
                  f"T={d['temperature']} max_new_tokens={d['max_new_tokens']}")
    lines = [
        f"target={report['target']}  drafter={report['drafter']}  prompts={report['prompts']} "
        f"({report['num_prompts']} prompts, {report['num_requests']} turns)",
        decode,
        # τ is null where nothing was speculated (auto total_tokens chose plain decoding)
        f"tau pooled={_fmt(report['tau_pooled'], '.3f')}  tau per-request mean="
        f"{_fmt(report['tau_per_request_mean'], '.3f')}  "
        f"emitted tokens outside the draft vocab={_fmt(report.get('oov_rate'), '.3f')}",
        "alpha_n: " + " ".join("n/a" if a is None else f"{a:.2f}" for a in report["per_position_acceptance"]),
        f"tokens/s: speculative={tps['speculative']:.1f} baseline={tps['baseline']:.1f}  "
        f"speedup={report['speedup'] if report['speedup'] is None else round(report['speedup'], 3)} ({budget})",
    ]
    if d.get("total_tokens_choice"):
        lines.append(f"auto total_tokens: {d['total_tokens_choice']['reason']}")
    if "outputs_identical_to_baseline" in report:
        o = report["outputs_identical_to_baseline"]
        ties = (f", {o['parted_at_near_ties']} more first part at a near-tie of plain decoding's top-2 logits "
                f"(within {o['near_tie_rtol']:g} relative: {report['dtype']} rounding)") if o.get("parted_at_near_ties") else ""
        lines.append(f"outputs identical to baseline: {o['count']}/{o['of']}{ties}")
    if report.get("adaptive_budget"):
        a = report["adaptive_budget"]
        lines.append(f"adaptive budget: mean m={a['mean_m']:.2f} (m=0 in {a['share_m0']:.0%} of cycles), "
                     f"calibration {a['calibration']:.2f}; predicted tau {a['tau_predicted']:.3f} / measured "
                     f"{a['tau_measured']:.3f}, predicted speedup {a['speedup_predicted']:.3f}")
    if "prompt_lookup" in report:
        p = report["prompt_lookup"]
        lines.append(f"prompt lookup (HF): {p['tokens_per_s']:.1f} tok/s, speedup {p['speedup']}, "
                     f"vs HF plain generate {p['speedup_vs_hf_generate_plain']:.3f}")
    if "categories" in report:
        lines += ["", report_markdown(report)]
    return "\n".join(lines)
