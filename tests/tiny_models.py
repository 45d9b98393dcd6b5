"""Tiny targets and drafters for tests and smoke runs (CPU, seconds).

`tiny_pair` gives a random Llama target and a random drafter with matching geometry (acceptance is
rare: good for exactness, weak for long accepted paths). `permutation_pair` builds a target whose
next token is mostly a fixed permutation π of the current one, plus a drafter constructed (not trained)
to predict π of its input feature at every depth, so long draft paths are accepted and sometimes
rejected, exercising multi-token acceptance and the KV bookkeeping after it. `rank_goodness_of_fit` tests
sampled outputs against the target's distribution; `check_state` checks a decoder's KV caches after a generation.
"""

from __future__ import annotations

import torch


def tiny_llama(
    vocab: int = 32,
    hidden: int = 32,
    layers: int = 3,
    heads: int = 2,
    kv_heads: int = 1,
    intermediate: int = 64,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    attn_implementation: str = "sdpa",
    init_std: float = 0.2,  # larger than HF's 0.02, so greedy text does not collapse into one repeated token
):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        initializer_range=init_std,
    )
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(dtype).eval().requires_grad_(False)


def tiny_drafter(
    target,
    tap_layers: list[int] | None = None,
    draft_token_ids: list[int] | None = None,
    intermediate: int | None = None,
    seed: int = 0,
):
    """A random Eagle3Drafter for `target` (embedding copied from it). draft_token_ids: the target ids
    of the reduced draft vocabulary (sorted); None = the full vocabulary."""
    from models.eagle3 import Eagle3Config, Eagle3Drafter

    hf = target.config.to_dict()
    vocab = int(hf["vocab_size"])
    ids = sorted(draft_token_ids) if draft_token_ids is not None else list(range(vocab))
    aux = list(tap_layers) if tap_layers is not None else list(range(min(3, hf["num_hidden_layers"])))
    overrides = {"intermediate_size": intermediate} if intermediate else {}
    cfg = Eagle3Config.from_target_config(hf, draft_vocab_size=len(ids), tap_layers=aux, **overrides)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg)
    embed = target.get_input_embeddings().weight
    drafter.to(embed.dtype)
    drafter.load_target_embedding(embed.detach().clone())
    id_t = torch.tensor(ids, dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[id_t] = True
    drafter.set_vocab_mapping(id_t - torch.arange(len(ids)), t2d)
    return drafter.eval().requires_grad_(False)


def tiny_dflash_drafter(
    target, tap_layers: list[int] | None = None, block_size: int = 4, num_layers: int = 2,
    mask_token_id: int | None = None, seed: int = 0,
):
    """A random DFlashDrafter for `target` (its embedding and LM head copied), in the target's dtype.
    mask_token_id None = the last token id."""
    from models.dflash import DFlashConfig, DFlashDrafter

    hf = target.config.to_dict()
    taps = list(tap_layers) if tap_layers is not None else list(range(min(3, hf["num_hidden_layers"])))
    mask = int(hf["vocab_size"]) - 1 if mask_token_id is None else mask_token_id
    cfg = DFlashConfig.from_target_config(hf, mask_token_id=mask, tap_layers=taps, num_hidden_layers=num_layers,
                                          block_size=block_size)
    torch.manual_seed(seed)
    embed = target.get_input_embeddings().weight
    drafter = DFlashDrafter(cfg).to(embed.dtype)
    drafter.load_target_weights(embed.detach().clone(), target.get_output_embeddings().weight.detach().clone())
    return drafter.eval().requires_grad_(False)


def tiny_pair(vocab: int = 32, seed: int = 0, draft_vocab: int | None = None, dtype=torch.float64, **kw):
    target = tiny_llama(vocab=vocab, seed=seed, dtype=dtype, **kw)
    ids = None
    if draft_vocab is not None:
        g = torch.Generator().manual_seed(seed + 1)
        ids = sorted(torch.randperm(vocab, generator=g)[:draft_vocab].tolist())
    return target, tiny_drafter(target, draft_token_ids=ids, seed=seed + 2)


@torch.no_grad()
def permutation_pair(
    vocab: int = 16,
    hidden: int = 32,
    layers: int = 3,
    noise: float = 0.3,
    sharpness: float = 4.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
):
    """(target, drafter, π). Embeddings are orthogonal directions u_x (scaled); the target's layers are
    random with the residual writes scaled by `noise`, so its residual stream is u_{x_t} plus context; its LM head row π(x)
    is sharpness * u_x, so greedy mostly emits π(x_t) and context sometimes overrides it.

    Drafter: fc takes the first tap (~ u_{x_t}); attention is switched off (o_proj = 0); the SwiGLU MLP
    maps u_x -> u_{π(x)} - u_x with one unit per token, so h = hidden + mlp ~ u_{π(x)}: one drafter
    step advances the permutation once, and its LM head (the target's) then predicts π(π(x)) - exactly
    the token two places on, at every depth.
    """
    if hidden < vocab:
        raise ValueError("need hidden >= vocab for orthogonal token directions")
    target = tiny_llama(vocab=vocab, hidden=hidden, layers=layers, intermediate=2 * hidden, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 10)
    perm = torch.randperm(vocab, generator=g)
    u = torch.linalg.qr(torch.randn(hidden, hidden, generator=g, dtype=torch.float64))[0][:vocab].to(dtype)
    m = target.model
    m.embed_tokens.weight.copy_(u)
    for name, w in m.layers.named_parameters():
        if w.dim() == 2:  # unit-gain random projections; the ones writing to the residual scaled by noise
            gain = noise if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            w.copy_(torch.randn(w.shape, generator=g, dtype=torch.float64) * gain / w.shape[1] ** 0.5)
    lm = torch.zeros(vocab, hidden, dtype=dtype)
    lm[perm] = sharpness * u  # row π(x) = sharpness * u_x
    target.lm_head.weight.copy_(lm)

    drafter = tiny_drafter(target, tap_layers=[0, 1, 2][:layers], intermediate=vocab, seed=seed + 3)
    sd = drafter.state_dict()
    n_taps = len(drafter.cfg.tap_layers)
    fc = torch.zeros(hidden, n_taps * hidden, dtype=dtype)
    fc[:, :hidden] = torch.eye(hidden, dtype=dtype)
    updates = {
        "fc.weight": fc,
        "midlayer.self_attn.o_proj.weight": torch.zeros_like(sd["midlayer.self_attn.o_proj.weight"]),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden, dtype=dtype),
        "norm.weight": torch.ones(hidden, dtype=dtype),
        "lm_head.weight": lm,
    }
    # post_attention_layernorm(u_x) = sqrt(H) * u_x (unit rows): gate/up rows pick token x's direction.
    s_gate = 4.0
    scale = hidden ** 0.5
    act = torch.nn.functional.silu(torch.tensor(s_gate * scale, dtype=torch.float64)) * scale
    updates["midlayer.mlp.gate_proj.weight"] = s_gate * u
    updates["midlayer.mlp.up_proj.weight"] = u.clone()
    updates["midlayer.mlp.down_proj.weight"] = ((u[perm] - u).T / act).to(dtype)  # column x: u_π(x) - u_x
    missing = set(updates) - set(sd)
    if missing:
        raise KeyError(f"drafter state dict lacks {sorted(missing)}: update tests/tiny_models.py to its layout")
    sd.update(updates)
    drafter.load_state_dict(sd)
    return target, drafter.eval(), perm


@torch.no_grad()
def rank_goodness_of_fit(target_runner, prompt: list[int], outputs: list[list[int]], params) -> float:
    """p-value of "every output token was drawn from the target's (warped) distribution at its prefix".

    For each generated token, its rank r under p_t (most likely first) is one draw of a categorical with
    probabilities sorted(p_t). Observed rank counts O minus their expectations E = Σ_t sorted(p_t) is a
    martingale sum with covariance Σ_t (diag(π_t) - π_t π_tᵀ), so (O-E)ᵀ Σ⁻¹ (O-E) is chi-square
    with k - 1 degrees of freedom (rare tail ranks merged until they expect >= 10). Valid for sequences
    of any length and any stopping rule that depends on the past (EOS, budget). Ranks, not token ids,
    because lossy speculative rules move mass to or from the drafted token, usually the top-ranked one.
    Returns 0.0 if some token has probability 0 under the target.
    """
    from scipy import stats

    from eval.sampling import target_probs

    vocab = int(target_runner.model.config.get_text_config().vocab_size)
    obs = torch.zeros(vocab, dtype=torch.float64)
    exp = torch.zeros(vocab, dtype=torch.float64)
    cov = torch.zeros(vocab, vocab, dtype=torch.float64)
    for out in outputs:
        if not out:
            continue
        logits = target_runner.forward(prompt + out[:-1], target_runner.new_cache(), want_taps=False).logits
        probs = target_probs(logits[len(prompt) - 1:], params).cpu()  # [len(out), V]: p_t per new token
        for p, x in zip(probs, out):
            if p[x] <= 0:
                return 0.0
            order = torch.sort(-p, stable=True).indices
            ps = p[order]
            obs[int((order == x).nonzero())] += 1
            exp += ps
            cov += torch.diag(ps) - torch.outer(ps, ps)
    k = vocab
    while k > 2 and float(exp[k - 1:].sum()) < 10:
        k -= 1
    merge = torch.zeros(k, vocab, dtype=torch.float64)
    merge[torch.arange(vocab).clamp(max=k - 1), torch.arange(vocab)] = 1.0
    d = (merge @ (obs - exp))[:-1]  # one category is implied by the total
    c = (merge @ cov @ merge.T)[:-1, :-1]
    stat = float(d @ torch.linalg.solve(c, d))
    return float(stats.chi2.sf(stat, k - 1))


def check_state(dec, prompt: list[int], rec) -> None:
    """After `dec` (an eval.spec_decode.SpeculativeDecoder) generated `rec` from `prompt`: its target cache is a
    plain forward over the committed tokens, its drafter cache a fresh catch-up."""
    runner, drafter = dec.target, dec.drafter
    seq = prompt + rec.output_ids
    kept = dec.target_cache.get_seq_length()
    committed = min(kept, len(seq) - 1)  # beyond that the cache holds tokens past an EOS / budget cut
    ref = runner.new_cache()
    fresh = runner.forward(seq[:committed], ref)
    for a, b in zip(dec.target_cache.layers, ref.layers):
        torch.testing.assert_close(a.keys[..., :committed, :], b.keys, rtol=0, atol=1e-9)
        torch.testing.assert_close(a.values[..., :committed, :], b.values, rtol=0, atol=1e-9)
    if not rec.accept_lengths:
        return
    # the drafter holds positions 0..n-1 of the final step (then that step's drafted nodes)
    n = kept - rec.accept_lengths[-1] - 1
    from models.attention import DecodeCache

    cache = DecodeCache()
    taps = fresh.taps[:n].to(drafter.fc.weight.dtype)
    drafter.forward_step(drafter.fuse(taps[None]), torch.tensor([seq[1:n + 1]]), torch.arange(n)[None], cache)
    # the drafter's RMSNorm computes in float32, so chunked vs one-shot differs at float32 rounding
    torch.testing.assert_close(dec.drafter_cache.k[:, :, :n], cache.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dec.drafter_cache.v[:, :, :n], cache.v, rtol=1e-5, atol=1e-5)
