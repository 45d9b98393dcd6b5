"""Evaluation of drafters by real speculative decoding (docs/method.md §1, §3, §4.2, §6).

    sampling.py     warp_logits / target_probs shared by plain and speculative decoding; the lossless
                    acceptance rules (accept min(1, p/q), residual norm(max(0, p - q)), multi-candidate)
    tree.py         draft trees as flat tensors: top-m selection, ancestor masks, position ids
    drafting.py     the drafting-strategy interface; EAGLE: catch-up, chain drafting, EAGLE-2 dynamic tree
    dflash_drafting.py  DFlash: one block per step from the cached target context, verified as a chain
    target.py       HF CausalLM forward with feature taps and tree masks; KV surgery (keep_kv)
    spec_decode.py  SpeculativeDecoder.generate and plain_generate (token ids only), GenerationRecord
    metrics.py      τ pooled / per request, α_n, accepted-length histogram
    budget.py       the verify budget m: choose_total_tokens (the best predicted speedup, m = 0 included, from
                    forwards timed at decoding's context and a probe's acceptance), AdaptiveBudget per cycle
    prompts.py      the shipped suites and JSONL prompts (validated: file and line named), chat rendering
    categories.py   per (suite, category): τ with a bootstrap interval (5 prompts or more), α, outputs, tokens/s
    engine.py       the same prompts through vLLM's own server serving the export (engine=vllm): its counters,
                    tokens/s, a draft-settings sweep and a load sweep, warmed up, the same sampling both sides
    run.py          the eval run behind launch/eval.py: report.json, plots, summary
    peers.py        transformers' prompt-lookup assisted decoding as a peer baseline
    plots.py        the report's plots (α per depth, categories)
"""
