"""Does a regenerated reply's text give back the ids the target generated? On the embedded target, through the
prep's own code: the hf backend regenerates the first turns of `--conversations` ShareGPT conversations (the
prep's plan: shortest first prompts first) greedily with `--max-new-tokens`, the generated ids are recorded, and
each reply is compared two ways with them:

- re-encoded: the reply's text rendered with the chat template alone (what prep trained on before the generated
  ids were kept), its masked tokens without the end of turn;
- rendered: the sample prep writes (data_prep.chat.render_conversation of the regenerated conversation, which
  splices in Message.token_ids), its masked tokens without the end of turn.

    python bench/regen_reencode.py --conversations 20 --max-new-tokens 256

Writes bench/results/regen_reencode.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/regen_reencode.json")
    a = ap.parse_args()

    import torch

    from data_prep.chat import render_conversation
    from data_prep.config import PrepConfig
    from data_prep.conversations import load_conversations
    from data_prep.pipeline import plan_regeneration
    from data_prep.regenerate import HFBackend, load_regenerated, regenerate
    from data_prep.targets import load_target, resolve_target

    torch.set_num_threads(a.threads)
    preset = resolve_target("smollm2-135m-instruct")
    model, tok = load_target(preset)
    cfg = PrepConfig(model=preset.name, out="unused")
    cfg.regen.max_new_tokens = a.max_new_tokens
    pool, _ = load_conversations("sharegpt-embedded", max_records=4 * a.conversations)
    convs, _ = plan_regeneration(cfg, preset, tok, pool)
    convs = convs[: a.conversations]

    generated: dict[str, list[int]] = {}  # the last user turn's text -> the ids generated for it

    class Recording(HFBackend):
        def _decode(self, ids, stop):
            kept, text, cut = super()._decode(ids, stop)
            generated[text] = kept
            return kept, text, cut

    backend = Recording(model, tok)
    stop = set(backend._stop_ids({}))
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        regenerate(convs, backend, Path(tmp) / "r.jsonl", max_new_tokens=a.max_new_tokens, batch_size=len(convs),
                   max_turns=1, progress=False)
        done = load_regenerated(Path(tmp) / "r.jsonl")
    seconds = time.time() - t0
    by_text = {tok.decode(ids, skip_special_tokens=False).strip(): ids for ids in generated.values()}

    def taught(messages) -> list[int]:
        r = render_conversation(tok, messages, max_length=4096)
        ids = [t for t, m in zip(r.input_ids, r.loss_mask) if m]
        return ids[:-1] if ids and ids[-1] in stop else ids

    rows = []
    for c in done:
        reply = c.messages[-1]
        gen = by_text[reply.content]
        plain = [*c.messages[:-1], replace(reply, token_ids=None)]
        rows.append({"id": c.id, "generated_tokens": len(gen), "cut_at_cap": reply.cut,
                     "ids_kept": reply.token_ids is not None, "re_encoded_equal": taught(plain) == gen,
                     "rendered_equal": taught(c.messages) == gen})
    result = {"what": "regenerated replies whose training tokens equal the generated ids", "target": preset.name,
              "max_new_tokens": a.max_new_tokens, "replies": len(rows), "seconds": round(seconds, 1),
              "cut_at_cap": sum(r["cut_at_cap"] for r in rows), "ids_kept": sum(r["ids_kept"] for r in rows),
              "re_encoded_equal": sum(r["re_encoded_equal"] for r in rows),
              "rendered_equal": sum(r["rendered_equal"] for r in rows),
              "differing": [r for r in rows if not (r["re_encoded_equal"] and r["rendered_equal"])]}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
