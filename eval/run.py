"""End-to-end evaluation: load target + exported drafter, decode prompts speculatively and plainly, report.

Every generated turn is one "request" (τ per request, samples). Speedup = tokens/s of speculative
decoding / tokens/s of plain decoding, same target, prompts, max_new_tokens, machine and run
(docs/method.md §6). The verify budget m (total_tokens) is reported next to it.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from eval import metrics
from eval.budget import AdaptiveBudget, CycleCost, VerifyCost, choose_total_tokens
from eval.categories import (
    CI_DEFINITION,
    acceptance_of,
    category_entries,
    groups,
    report_markdown,
    suite_entries,
)
from eval.config import EvalConfig
from eval.prompts import load_prompts, render
from eval.sampling import SamplingParams
from eval.spec_decode import GenerationRecord, SpecSettings, SpeculativeDecoder, plain_generate
from eval.target import TargetRunner
from infra.strict_json import dumps
from models.export import CONFIG_FILE
from models.registry import DrafterFamily, family, family_of_drafter

REPORT_FILE = "report.json"
CATEGORIES_FILE = "categories.md"


def stop_token_ids(model, tokenizer, template_kwargs: dict | None = None) -> tuple[int, ...]:
    """EOS ids: the generation config's, the tokenizer's, and the chat template's end-of-turn token."""
    ids: list[int] = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for src in (gen_eos, tokenizer.eos_token_id):
        if src is None:
            continue
        ids.extend(src if isinstance(src, (list, tuple)) else [src])
    from data_prep.chat import end_of_turn

    try:
        eot = end_of_turn(tokenizer, template_kwargs=template_kwargs)
    except ValueError:
        eot = None
    if eot:
        eot_ids = tokenizer.convert_tokens_to_ids([eot])
        if eot_ids and eot_ids[0] is not None and eot_ids[0] != tokenizer.unk_token_id:
            ids.append(eot_ids[0])
    return tuple(dict.fromkeys(int(i) for i in ids))


def load_drafter(export_dir: str, target_model, device: str, dtype: torch.dtype, tokenizer=None,
                 target_name: str = "the target"):
    """Any family's export (models/registry.py), with the target's frozen tensors (embedding, LM head). An export
    that records another target than this one (its tokenizer too, when given), or tap layers other than those its
    config.json now names, is refused naming both (models.export.check_target)."""
    from eval.target import target_fingerprint
    from models.export import TARGET_KEY, ExportError, check_tap_layers, check_target
    from models.registry import family_of_export
    from models.target_head import EMBED_KEY, LM_HEAD_KEY, scaled_embedding_weight

    config_path = Path(export_dir) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"drafter {export_dir}: no {CONFIG_FILE} (an export dir holds {CONFIG_FILE} and "
                                "model.safetensors: launch/export.py writes one from a checkpoint)")
    raw = json.loads(config_path.read_text())
    actual = target_fingerprint(target_model.config.to_dict(), tokenizer, target_name)
    check_target(raw.get(TARGET_KEY), actual, f"drafter {export_dir}", f"target {target_name}")
    embed = scaled_embedding_weight(target_model)  # as the target embeds (Gemma: times sqrt(hidden))
    text_cfg = target_model.config.get_text_config()
    head = target_model.get_output_embeddings()
    weights = {EMBED_KEY: embed.detach().cpu()}
    if head is not None:
        weights[LM_HEAD_KEY] = head.weight.detach().cpu()
    try:
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
        raise ValueError(f"drafter vocab_size {drafter.cfg.vocab_size} != target vocab {embed.shape[0]}: "
                         "the drafter was trained for another target")
    tgt_h = getattr(drafter.cfg, "target_hidden_size", None) or drafter.cfg.hidden_size
    if tgt_h != text_cfg.hidden_size:
        raise ValueError(f"drafter expects target hidden size {tgt_h}, target has {text_cfg.hidden_size}")
    return drafter


def run_eval(cfg: EvalConfig, progress: bool = True) -> dict:
    from data_prep.targets import load_target, model_path, resolve_target

    cfg.validate()
    d = cfg.decode
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # the prompts first: a bad prompts file stops before the target is loaded
    records_in = load_prompts(cfg.prompts, per_category=d.num_prompts if d.num_prompts > 0 else None,
                              max_turns=d.max_turns if d.max_turns > 0 else None)
    preset = resolve_target(cfg.target)
    model, tokenizer = load_target(preset, dtype=cfg.dtype, device=device, chat_template=cfg.chat_template)
    drafter = load_drafter(cfg.drafter, model, device, next(model.parameters()).dtype, tokenizer, preset.name)
    session = None
    if cfg.engine == "vllm":  # before decoding: the engine's python, the export as vLLM loads it, the lengths
        session = engine_session(cfg, preset, tokenizer, model)
    runner = TargetRunner(model, drafter.tap_layers)
    template_kwargs = {} if preset.enable_thinking is None else {"enable_thinking": preset.enable_thinking}
    if session is not None:
        check_engine_lengths(records_in, tokenizer, template_kwargs, d.max_new_tokens, cfg.vllm.max_model_len)
    eos = stop_token_ids(model, tokenizer, template_kwargs)
    params = SamplingParams(d.temperature, d.top_p, d.top_k)

    decoder, budget, (total_tokens, timings, choice) = build_decoder(d, runner, drafter, progress)

    if cfg.warmup:  # first calls pay one-off allocation / kernel selection costs
        ids = render(tokenizer, records_in[0].messages(0, []), template_kwargs)
        decoder.generate(ids, min(8, d.max_new_tokens), params, eos, torch.Generator().manual_seed(0))
        if cfg.baseline:
            plain_generate(runner, ids, min(8, d.max_new_tokens), params, eos, torch.Generator().manual_seed(0))
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
    if session is not None:
        add_engine(report, session, samples, d, eos, cost, progress)
    report["samples"] = samples
    write_report(report, Path(cfg.out_dir), cfg.plots)
    return report


def engine_session(cfg: EvalConfig, preset, tokenizer, model):
    """vLLM's python resolved and the export checked as vLLM will load it, before any decoding (eval/engine.py)."""
    from data_prep.targets import model_path
    from eval.engine import EngineSession, check_export

    method = check_export(cfg.drafter, preset, tokenizer)
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return EngineSession(cfg.vllm, model_path(preset), dtype, cfg.drafter, method, Path(cfg.out_dir) / "engine")


def check_engine_lengths(records, tokenizer, template_kwargs: dict, max_new_tokens: int, max_model_len: int) -> None:
    """A prompt whose last turn cannot fit the engine's context (its turns, and max_new_tokens for each answer)
    stops the evaluation before anything is decoded, naming it, rather than failing in the engine afterwards."""
    for r in records:
        last = len(r.turns) - 1
        need = len(render(tokenizer, r.messages(last, [""] * last), template_kwargs)) + max_new_tokens * len(r.turns)
        if need > max_model_len:
            raise ValueError(f"prompt {r.suite}/{r.id} ({r.category}) needs up to {need} tokens with its answers, more "
                             f"than vllm.max_model_len={max_model_len}: raise it or lower decode.max_new_tokens")


def add_engine(report: dict, session, samples: list[dict], d, eos, cost: CycleCost, progress: bool) -> None:
    """The same turns through vLLM (eval/engine.py): each category's `engine` entry beside ours, the pooled engine
    figures, the draft-settings sweep and the load sweep."""
    from eval import engine
    from eval.categories import tau_outside_interval

    g = groups(samples)
    turns = {key: [samples[i]["prompt_token_ids"] for i in idx] for key, idx in g.items()}
    first = [s["prompt_token_ids"] for s in samples if s["turn"] == 0]
    body = {"max_tokens": d.max_new_tokens, "temperature": d.temperature, "top_p": d.top_p,
            "stop_token_ids": list(eos), "skip_special_tokens": False}
    if d.top_k > 0:
        body["top_k"] = d.top_k
    if d.temperature > 0:
        body["seed"] = d.seed
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
        "name": "vllm", "method": session.method, "num_speculative_tokens": k, "python": session.python,
        "tau": 1 + accepted / drafts if drafts else None,
        "num_speculative_tokens_swept": [int(x) for x in res["categories"]],
        "load": load,
        "definition": "τ = 1 + accepted / drafts from vLLM's spec_decode counters; α_n conditional as ours; tokens/s "
                      "= output tokens / the requests' wall time, one request at a time (load: c in flight, "
                      "ignore_eos, tokens / the level's wall time); identical: token ids equal, a final stop id "
                      "aside",
    }


def build_decoder(d, runner, drafter, progress: bool):
    """The speculative decoder of `decode.*`: its verify budget (the tree's total tokens, measured when
    decode.auto_total_tokens) and adaptive budget -> (decoder, adaptive budget or None, (total tokens, the timings
    behind the choice, the choice))."""
    total_tokens, timings, choice = d.total_tokens, None, None
    if d.mode == "tree" and d.auto_total_tokens:
        choice = choose_total_tokens(runner, list(d.total_tokens_candidates), d.auto_tolerance)
        total_tokens, timings = choice.m, choice.timings
        if progress:
            print(f"auto total_tokens: {choice.reason}", flush=True)
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
        same = sum(s.output_ids == b.output_ids for s, b in zip(spec_recs, base_recs))
        report["outputs_identical_to_baseline"] = {"count": same, "of": len(base_recs),
                                                   "expected_all": params.greedy}
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
        f"tau pooled={report['tau_pooled']:.3f}  tau per-request mean={report['tau_per_request_mean']:.3f}  "
        f"emitted tokens outside the draft vocab={report.get('oov_rate', float('nan')):.3f}",
        "alpha_n: " + " ".join("n/a" if a is None else f"{a:.2f}" for a in report["per_position_acceptance"]),
        f"tokens/s: speculative={tps['speculative']:.1f} baseline={tps['baseline']:.1f}  "
        f"speedup={report['speedup'] if report['speedup'] is None else round(report['speedup'], 3)} ({budget})",
    ]
    if d.get("total_tokens_choice"):
        lines.append(f"auto total_tokens: {d['total_tokens_choice']['reason']}")
    if "outputs_identical_to_baseline" in report:
        o = report["outputs_identical_to_baseline"]
        lines.append(f"outputs identical to baseline: {o['count']}/{o['of']}")
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
