"""Prep-time proof that what a prep stores reproduces the target, checked before anything is generated or written.

Training never sees the target again: it recomputes the teacher's logits from the stored final hidden state
with the stored head (models/target_head.py) and reads the stored taps as the target's hidden states. So on a
probe batch (the first conversations, rendered as the dataset wrote them, right after the target is loaded and
before any regeneration) ONE forward of the whole target is compared with what the prep computes from it,
at the positions the attention mask keeps:

| piece | what the prep computes | the target's own |
|---|---|---|
| input embedding | head.embed(ids) (the scale drafters embed with) | hidden_states[0], decoder layer 0's input |
| tap i | the capture hook after layer i (what the shards store) | hidden_states[i + 1] (what decoding reads) |
| teacher | the capture hook after the last layer | the final norm's input |
| final norm | head.norm(teacher) | the final norm's output |
| LM head | head.logits(teacher) (norm, head, soft-capping) | the target's logits, and their argmax |

Tolerance (max abs difference): 1e-4 in fp32 (and fp64); in bf16/fp16, HALF_ULPS units in the last place at the
largest magnitude compared, since the head's kernels may round otherwise than the target's. The argmax must be
the same at every position (in half precision: wherever the target's top two logits are further apart than the
tolerance). A mismatch raises FidelityError naming the family and each piece that differs. What the shards then
store is the capture rounded to the stored dtype (bf16 by default: data_prep/shards.py), a separate rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from data_prep.capture import HiddenStateCapture, pad_right
from data_prep.chat import Dropped, render_conversation
from data_prep.conversations import Conversation
from models.target_head import TargetHead, final_norm

FP32_ATOL = 1e-4
HALF_ULPS = 2
PROBE_SAMPLES = 2  # conversations in the probe batch
PROBE_TOKENS = 128  # tokens kept of each: the probe holds [samples, tokens, V] logits twice (target's, head's)
PIECE_HINTS = {
    "input embedding": "the stored embedding scale (HeadSpec.embed_scale) is not the target's",
    "tap": "the stored tap is not the hidden state HF's output_hidden_states gives for that layer, which is "
           "what decoding feeds the drafter (data_prep/capture.py's hooks vs the layer layout)",
    "teacher": "the stored teacher is not the last decoder layer's output the final norm reads",
    "final norm": "the stored head rebuilds the final norm differently (HeadSpec.norm_class)",
    "LM head": "the stored head's logits differ (LM head weights, soft-capping or a logit scale it lacks)",
}


class FidelityError(ValueError):
    """What a prep would store does not reproduce the target's own computation."""


def tolerance(dtype: torch.dtype, reference: Tensor) -> float:
    if dtype in (torch.float32, torch.float64):
        return FP32_ATOL
    return HALF_ULPS * torch.finfo(dtype).eps * max(1.0, float(reference.abs().max()))


def probe_batch(tokenizer, conversations: Sequence[Conversation], max_len: int,
                template_kwargs: dict) -> tuple[Tensor, Tensor]:
    """(input_ids, attention_mask) of the first PROBE_SAMPLES conversations, rendered with the chat template
    (their text alone where the template refuses one), PROBE_TOKENS tokens at most each, right-padded."""
    length = min(max_len, PROBE_TOKENS)
    seqs = []
    for conv in conversations[:PROBE_SAMPLES]:
        r = render_conversation(tokenizer, conv.messages, max_len=length, template_kwargs=template_kwargs)
        ids = (tokenizer("\n".join(m.content for m in conv.messages), add_special_tokens=False)["input_ids"]
               if isinstance(r, Dropped) else r.input_ids)
        if ids:
            seqs.append(torch.tensor(ids[:length]))
    if not seqs:
        raise ValueError("no conversation gives a token to probe the target with")
    return pad_right(seqs)


def _kept(x: Tensor, keep: Tensor, device: torch.device) -> Tensor:
    return x[keep.to(x.device)].to(device).float()


def _max_diff(ours: Tensor, theirs: Tensor, keep: Tensor) -> tuple[float, Tensor]:
    """(max abs difference at the kept positions, the target's values there)."""
    a, b = _kept(ours, keep, ours.device), _kept(theirs, keep, ours.device)
    return float((a - b).abs().max()), b


@torch.no_grad()
def check_fidelity(model: nn.Module, head: TargetHead, capture: HiddenStateCapture, input_ids: Tensor,
                   attention_mask: Tensor) -> dict:
    """Compare every piece (module docstring) on one forward of `model` over the probe batch; the measured
    differences as a dict, or FidelityError naming the family and the pieces that differ."""
    norm, seen = final_norm(model), {}
    hooks = [norm.register_forward_pre_hook(lambda _m, args: seen.__setitem__("norm_in", args[0])),
             norm.register_forward_hook(lambda _m, _a, out: seen.__setitem__("norm_out", out))]
    try:
        got, out = capture.with_reference(input_ids, attention_mask)
    finally:
        for h in hooks:
            h.remove()
    keep = attention_mask.bool()
    layers, hs = capture.num_layers, out.hidden_states
    dtype = got.final_hidden.dtype
    family = head.family
    if hs is None or len(hs) != layers + 1:
        raise FidelityError(f"{family}: output_hidden_states gives {0 if hs is None else len(hs)} entries, not "
                            f"{layers + 1} (the embedding output + one per decoder layer): its taps cannot be checked")
    hidden = got.final_hidden.shape[-1]
    pairs: list[tuple[str, Tensor, Tensor]] = [
        ("input embedding", head.embed(input_ids.to(head.embed_tokens.weight.device)), hs[0]),
    ]
    for j, layer in enumerate(capture.tap_layers):
        # the last layer's entry in hidden_states is after the final norm; its output is the norm's input
        ref = hs[layer + 1] if layer < layers - 1 else seen["norm_in"]
        pairs.append((f"tap {layer}", got.taps[..., j * hidden:(j + 1) * hidden], ref))
    pairs += [("teacher", got.final_hidden, seen["norm_in"]),
              ("final norm", head.norm(got.final_hidden), seen["norm_out"]),
              ("LM head", head.logits(got.final_hidden), out.logits)]
    result: dict = {"family": family, "dtype": str(dtype).removeprefix("torch."), "tokens": int(keep.sum()),
                    "max_abs_diff": {}, "tolerance": {}}
    failed = []
    for piece, ours, theirs in pairs:
        diff, ref = _max_diff(ours, theirs, keep)
        tol = tolerance(dtype, ref)
        result["max_abs_diff"][piece], result["tolerance"][piece] = diff, tol
        if not diff <= tol:
            hint = PIECE_HINTS["tap" if piece.startswith("tap ") else piece]
            failed.append(f"{piece}: max abs difference {diff:.4g} > {tol:.3g} ({hint})")
    ours_top = _kept(pairs[-1][1], keep, pairs[-1][1].device)
    ref_logits = _kept(out.logits, keep, ours_top.device)
    same = ours_top.argmax(-1) == ref_logits.argmax(-1)
    top2 = ref_logits.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > (0.0 if dtype in (torch.float32, torch.float64)
                                             else result["tolerance"]["LM head"])
    result["argmax_agreement"] = float(same.float().mean())
    if not bool(same[decisive].all()):
        failed.append(f"LM head: argmax differs at {int((~same & decisive).sum())} of {int(decisive.sum())} "
                      "positions")
    if failed:
        arch = type(model).__name__
        raise FidelityError(f"fidelity check failed for the {family} target ({arch}, {result['dtype']}): what the "
                            "prep would store does not reproduce the target's own computation on the probe batch "
                            f"({result['tokens']} tokens), so prep stops before regenerating or writing anything. "
                            "Differs: " + "; ".join(failed))
    return result


# An engine's capture (capture.engine=vllm) is another implementation of the target's forward (its own kernels,
# reduction order, fused residual adds), so it cannot match bit for bit: it is held to a tolerance relative to
# the largest magnitude compared, far below what a wrong layer gives (adjacent layers' residual streams differ
# by a sizeable fraction of it). fp32: measured <= 1.5e-6 on the embedded target (bench/results/vllm_capture.json).
ENGINE_RTOL = {torch.float32: 1e-5, torch.float64: 1e-5}
ENGINE_RTOL_HALF = 2.0 ** -6


def engine_tolerance(dtype: torch.dtype, reference: Tensor) -> float:
    return ENGINE_RTOL.get(dtype, ENGINE_RTOL_HALF) * max(1.0, float(reference.abs().max()))


@torch.no_grad()
def check_engine_fidelity(model: nn.Module, head: TargetHead, tap_layers: Sequence[int], probe: Sequence[Tensor],
                          taps: Sequence[Tensor], teachers: Sequence[Tensor], engine: str = "vLLM") -> dict:
    """An engine's capture of the probe sequences (taps [T, n_taps*H] in tap order and teacher [T, H] per sequence)
    against ONE forward of `model` (the references of `check_fidelity`: hidden_states[i + 1] per tap, the final
    norm's input and output, the logits' argmax). Max abs and relative (to the largest reference magnitude)
    difference per piece; FidelityError naming the pieces beyond `engine_tolerance` or an argmax that differs
    where the target's top two logits are further apart than the LM head's tolerance."""
    from data_prep.capture import decoder_layers

    norm, seen = final_norm(model), {}
    hooks = [norm.register_forward_pre_hook(lambda _m, args: seen.__setitem__("norm_in", args[0])),
             norm.register_forward_hook(lambda _m, _a, out: seen.__setitem__("norm_out", out))]
    input_ids, attention_mask = pad_right(list(probe))
    device = next(model.parameters()).device
    try:
        out = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False,
                    output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    layers, hs = len(decoder_layers(model)), out.hidden_states
    keep = attention_mask.bool()
    ours_taps = pad_right_features(taps, keep)
    ours_teacher = pad_right_features(teachers, keep)
    hidden = ours_teacher.shape[-1]
    dtype = ours_teacher.dtype
    pairs: list[tuple[str, Tensor, Tensor]] = []
    for j, layer in enumerate(tap_layers):
        ref = hs[layer + 1] if layer < layers - 1 else seen["norm_in"]
        pairs.append((f"tap {layer}", ours_taps[..., j * hidden:(j + 1) * hidden], ref))
    head_device = head.lm_head.weight.device
    teacher_dev = ours_teacher.to(head_device)
    pairs += [("teacher", ours_teacher, seen["norm_in"]), ("final norm", head.norm(teacher_dev), seen["norm_out"]),
              ("LM head", head.logits(teacher_dev), out.logits)]
    result: dict = {"engine": engine, "family": head.family, "dtype": str(dtype).removeprefix("torch."),
                    "tokens": int(keep.sum()), "max_abs_diff": {}, "max_rel_diff": {}, "tolerance": {}}
    failed = []
    for piece, ours, theirs in pairs:
        diff, ref = _max_diff(ours.to(theirs.device), theirs, keep)
        tol = engine_tolerance(dtype, ref)
        result["max_abs_diff"][piece], result["tolerance"][piece] = diff, tol
        result["max_rel_diff"][piece] = diff / max(1e-30, float(ref.abs().max()))
        if not diff <= tol:
            hint = PIECE_HINTS["tap" if piece.startswith("tap ") else piece]
            failed.append(f"{piece}: max abs difference {diff:.4g} > {tol:.3g} ({hint})")
    ours_logits = _kept(pairs[-1][1], keep, head_device)
    ref_logits = _kept(out.logits, keep, head_device)
    same = ours_logits.argmax(-1) == ref_logits.argmax(-1)
    top2 = ref_logits.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > result["tolerance"]["LM head"]
    result["argmax_agreement"] = float(same.float().mean())
    if not bool(same[decisive].all()):
        failed.append(f"LM head: argmax differs at {int((~same & decisive).sum())} of {int(decisive.sum())} "
                      "positions")
    if failed:
        raise FidelityError(f"{engine} capture fidelity check failed for the {head.family} target "
                            f"({result['dtype']}): the engine's hidden states do not reproduce the target's own "
                            f"forward on the probe batch ({result['tokens']} tokens), so prep stops before writing "
                            "anything. Differs: " + "; ".join(failed))
    return result


@torch.no_grad()
def check_engine_head(head: TargetHead, probe: Sequence[Tensor], teachers: Sequence[Tensor],
                      engine_choice: Sequence[dict], engine: str = "vLLM") -> dict:
    """Without the transformers target: the prep's head applied to the engine's teacher [T, H] of each probe
    sequence against the engine's own next-token choice (`engine_choice`: per sequence `top1` [T] and
    `top1_logprob` [T], its top-1 after every position). The argmax must agree wherever the head's top two logits
    are further apart than the LM head's tolerance, and the log-probability the head gives the engine's token
    must be that token's log-probability in the engine within twice that tolerance (a logit and the log-sum-exp,
    each within it). This ties the shards' teacher to the engine's own logits and the head that training applies
    to it; the taps, read from the same residual stream as the teacher, are compared with the transformers
    forward by check_engine_fidelity (vllm.capture_fidelity=hf). FidelityError naming what differs."""
    device = head.lm_head.weight.device
    dtype = teachers[0].dtype
    positions = agreed = decisive_misses = 0
    max_lp, tol = 0.0, 0.0
    for seq, teacher, choice in zip(probe, teachers, engine_choice):
        if "top1" not in choice or len(choice["top1"]) != len(seq):
            raise FidelityError(f"{engine} returned no top-1 for every position of a probe sequence ({len(seq)} "
                                f"tokens): got {len(choice.get('top1') or [])}")
        logits = head.logits(teacher.to(device)).float()
        ids = torch.tensor(choice["top1"], device=device)
        seq_tol = engine_tolerance(dtype, logits)
        tol = max(tol, seq_tol)
        top2 = logits.topk(2, dim=-1).values
        same = logits.argmax(-1) == ids
        decisive = (top2[:, 0] - top2[:, 1]) > seq_tol
        positions += len(seq)
        agreed += int(same.sum())
        decisive_misses += int((~same & decisive).sum())
        theirs = torch.tensor(choice["top1_logprob"], device=device, dtype=torch.float32)
        ours = logits.log_softmax(-1).gather(-1, ids[:, None])[:, 0]
        max_lp = max(max_lp, float((ours - theirs).abs().max()))
    result = {"engine": engine, "check": "head on the engine's teacher vs the engine's own top-1",
              "family": head.family, "dtype": str(dtype).removeprefix("torch."), "tokens": positions,
              "argmax_agreement": agreed / max(positions, 1), "max_logprob_diff": max_lp,
              "logprob_tolerance": 2 * tol}
    failed = []
    if decisive_misses:
        failed.append(f"the head's argmax differs from {engine}'s top-1 at {decisive_misses} of {positions} "
                      "positions where its top two logits are further apart than the tolerance")
    if not max_lp <= 2 * tol:
        failed.append(f"the log-probability of {engine}'s top-1 differs by up to {max_lp:.4g} > {2 * tol:.3g}")
    if failed:
        raise FidelityError(f"{engine} capture fidelity check failed for the {head.family} target "
                            f"({result['dtype']}): the prep's target head on {engine}'s teacher hidden states does "
                            f"not reproduce {engine}'s own next-token choice on the probe batch ({positions} tokens) "
                            "(a head from another checkpoint, the wrong final layer, or a norm the head rebuilds "
                            "differently), so prep stops before writing anything: " + "; ".join(failed))
    return result


def pad_right_features(features: Sequence[Tensor], keep: Tensor) -> Tensor:
    """[B, T, D] of per-sequence [T_i, D] features, zero-padded on the right to `keep`'s width."""
    out = features[0].new_zeros(keep.shape[0], keep.shape[1], features[0].shape[-1])
    for i, f in enumerate(features):
        out[i, : f.shape[0]] = f
    return out
