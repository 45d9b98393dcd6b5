"""The reduced draft vocabulary: the Vd most frequent target tokens of the replies, sorted by id.

Engines map a draft id to a target id by an OFFSET table, target_id = draft_id + d2t[draft_id]
(docs/method.md §4.1); t2d marks which target ids the drafter can emit. Both ship with the drafter.

A token outside the draft vocabulary can never be drafted, so the count that ranks tokens should be as
large as it is cheap: besides the loss-masked tokens of the (regenerated) training split, prep counts the
assistant tokens of every conversation the dataset offers, rendered with the target's template (no model
forward; held-out conversations excluded). The ranking score mixes the two frequencies (`selection_scores`).

That dataset-wide count is batched (data_prep/chat.py `assistant_token_counts`) and cached (`cached_counts`):
a count is stored under `<DRAFTERS_CACHE or ~/.cache/drafters>/token_counts/<key>.safetensors`, the key a sha256
of all it depends on (`count_cache_key`: the conversations' content, the tokenizer, the chat template and its
arguments, max_len, the vocabulary size, the rendering code and the library versions), so any prep of the same
data with the same target reads it back in seconds. Deleting that directory only costs a recount.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from infra.files import save_safetensors
from infra.strict_json import dumps

VOCAB_FILE = "draft_vocab.safetensors"
COUNT_CACHE = "token_counts"  # under data_prep.targets.cache_dir()

if TYPE_CHECKING:
    from data_prep.conversations import Message


def count_tokens(samples: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """Frequency of each target id among loss-masked tokens. samples: (input_ids, loss_mask) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, mask in samples:
        counts += torch.bincount(ids[mask.bool()].long(), minlength=vocab_size)
    return counts


def selection_scores(train_counts: torch.Tensor, dataset_counts: torch.Tensor | None,
                     train_weight: float) -> torch.Tensor:
    """float64 [V]: train_weight · f_train + (1 − train_weight) · f_dataset, f = counts / their total.

    The training split's tokens (the target's own replies when regenerated) weigh `train_weight`; the
    dataset-wide count supplies the ranking of everything that split is too small to have seen.
    Without a dataset count (or an empty one) the score is f_train alone."""
    def freq(c: torch.Tensor) -> torch.Tensor:
        total = c.sum()
        return c.double() / total if total > 0 else torch.zeros_like(c, dtype=torch.float64)

    if dataset_counts is None or dataset_counts.sum() == 0:
        return freq(train_counts)
    return train_weight * freq(train_counts) + (1.0 - train_weight) * freq(dataset_counts)


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (d2t int64[Vd], t2d bool[V]) from per-token counts or scores [V] (higher = kept first).

    Vd = min(draft_vocab_size, V, number of distinct tokens seen): a draft row for a token that never
    occurs is never trained, so it is left out rather than padded in; draft_vocab_size <= 0 keeps the
    whole target vocabulary (d2t all 0). Ties are broken by the smaller id, so the result is deterministic.
    """
    vocab_size = counts.numel()
    seen = int((counts > 0).sum())
    if seen == 0:
        raise ValueError("no loss-masked tokens to build a draft vocabulary from")
    size = vocab_size if draft_vocab_size <= 0 else min(draft_vocab_size, vocab_size, seen)
    # Stable sort of -count keeps smaller ids first among equal counts.
    order = torch.sort(-counts, stable=True).indices[:size]
    selected = torch.sort(order).values  # draft ids follow target-id order
    d2t = selected - torch.arange(size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[selected] = True
    return d2t, t2d


def save_draft_vocab(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, counts: torch.Tensor,
                     dataset_counts: torch.Tensor | None = None, scores: torch.Tensor | None = None) -> None:
    """counts: the training split's loss-masked tokens; dataset_counts: the dataset-wide count; scores:
    the ranking d2t was cut from (what a drafter of another size is cut from, `draft_vocab_of_size`)."""
    tensors = {"d2t": d2t, "t2d": t2d, "token_counts": counts}
    if dataset_counts is not None:
        tensors["dataset_counts"] = dataset_counts
    if scores is not None:
        tensors["selection_scores"] = scores
    save_safetensors({k: v.contiguous() for k, v in tensors.items()}, path)


def load_draft_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = load_file(str(path))
    return tensors["d2t"], tensors["t2d"]


def draft_vocab_of_size(path: str | Path, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of another size cut from the same ranking as the saved vocabulary (older files without
    `selection_scores` rank by the training split's counts)."""
    tensors = load_file(str(path))
    return build_draft_vocab(tensors.get("selection_scores", tensors["token_counts"]), draft_vocab_size)


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Fraction of the counted tokens the draft vocabulary can emit."""
    total = counts.sum().item()
    return float(counts[t2d].sum().item() / total) if total else 0.0


def count_cache_key(tokenizer, conversations: Iterable[Sequence[Message]], settings: Mapping[str, Any]) -> str:
    """The cache key of a count of `conversations`' tokens: a sha256 of their content (what templates read, and
    the cut flags and generated ids render_conversation uses), the tokenizer's and the template's hashes,
    `settings` (JSON: template arguments, max_len, vocabulary size), the source of data_prep/chat.py (any change to
    the rendering or the mask is a new key) and the versions of the libraries that render and tokenize."""
    from importlib.metadata import version

    from data_prep import chat

    content = hashlib.sha256()
    for messages in conversations:  # ASCII JSON: unambiguous, and any text encodes
        content.update(dumps([[m.role, m.content, m.reasoning, m.cut, m.token_ids] for m in messages]).encode())
        content.update(b"\n")
    payload = {"conversations": content.hexdigest(), "tokenizer": chat.tokenizer_hash(tokenizer),
               "template": chat.template_hash(tokenizer), "settings": dict(settings),
               "code": hashlib.sha256(Path(chat.__file__).read_bytes()).hexdigest(),
               "versions": {lib: version(lib) for lib in ("transformers", "tokenizers", "jinja2")}}
    return hashlib.sha256(dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def cached_counts(key: str, vocab_size: int, compute: Callable[[], torch.Tensor],
                  cache: str | Path | None = None) -> torch.Tensor:
    """The counts stored under `key` (`count_cache_key`) in `cache` (default: data_prep.targets.cache_dir() /
    COUNT_CACHE), else `compute()`, stored there atomically (temporary file, then rename: concurrent ranks or preps
    never read a torn file). An unreadable entry is recomputed; a cache that cannot be written only warns."""
    from data_prep.targets import cache_dir

    path = Path(cache) if cache is not None else cache_dir() / COUNT_CACHE
    path = path / f"{key}.safetensors"
    if path.exists():
        try:
            with safe_open(str(path), framework="pt") as f:
                if (f.metadata() or {}).get("key") == key:
                    counts = f.get_tensor("counts")
                    if counts.shape == (vocab_size,) and counts.dtype == torch.int64:
                        return counts
        except Exception as err:  # noqa: BLE001 - a torn or foreign file: count again, and replace it
            print(f"warning: token count cache {path} unreadable ({type(err).__name__}: {err}); counting again",
                  file=sys.stderr)
    counts = compute()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_safetensors({"counts": counts.contiguous()}, tmp, metadata={"key": key})
        os.replace(tmp, path)
    except OSError as err:
        print(f"warning: token count not cached ({path}: {err})", file=sys.stderr)
    finally:
        tmp.unlink(missing_ok=True)
    return counts
