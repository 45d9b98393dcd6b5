"""Draft vocabulary: offsets, ordering, ties, and fewer distinct tokens than Vd."""

import pytest
import torch

from data_prep.vocab import (
    build_draft_vocab,
    count_tokens,
    coverage,
    draft_vocab_of_size,
    save_draft_vocab,
    selection_scores,
)


def test_offsets_map_draft_to_target_ids() -> None:
    counts = torch.tensor([0, 5, 1, 9, 0, 7, 3, 0])
    d2t, t2d = build_draft_vocab(counts, draft_vocab_size=3)
    draft_ids = torch.arange(3)
    target_ids = draft_ids + d2t  # the engines' convention: an OFFSET, not an absolute id
    assert target_ids.tolist() == [1, 3, 5]  # the 3 most frequent, sorted by id
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert t2d.nonzero().flatten().tolist() == [1, 3, 5]


def test_fewer_distinct_tokens_than_requested() -> None:
    counts = torch.tensor([0, 2, 0, 1, 0])
    d2t, t2d = build_draft_vocab(counts, draft_vocab_size=32000)
    assert d2t.numel() == 2 and (torch.arange(2) + d2t).tolist() == [1, 3]
    assert int(t2d.sum()) == 2


def test_ties_break_to_smaller_id_and_vd_clipped_to_v() -> None:
    counts = torch.tensor([4, 4, 4, 4])
    d2t, _ = build_draft_vocab(counts, draft_vocab_size=2)
    assert (torch.arange(2) + d2t).tolist() == [0, 1]
    d2t, _ = build_draft_vocab(counts, draft_vocab_size=10)
    assert d2t.numel() == 4 and d2t.abs().sum() == 0


def test_counts_only_loss_masked_tokens() -> None:
    ids = torch.tensor([1, 2, 2, 3])
    mask = torch.tensor([False, True, True, False])
    counts = count_tokens([(ids, mask)], vocab_size=5)
    assert counts.tolist() == [0, 0, 2, 0, 0]
    _, t2d = build_draft_vocab(counts, 1)
    assert coverage(counts, t2d) == 1.0
    with pytest.raises(ValueError, match="no loss-masked"):
        build_draft_vocab(torch.zeros(5, dtype=torch.int64), 3)


def test_whole_vocabulary_when_asked() -> None:
    counts = torch.tensor([0, 2, 0, 1, 0])
    d2t, t2d = build_draft_vocab(counts, draft_vocab_size=0)
    assert d2t.tolist() == [0] * 5 and bool(t2d.all())  # never-seen tokens included: identity mapping


def test_dataset_count_ranks_what_the_train_split_never_saw(tmp_path) -> None:
    train = torch.tensor([0, 6, 0, 2, 0, 0, 0])  # the regenerated replies: few distinct tokens
    dataset = torch.tensor([0, 10, 0, 0, 30, 60, 0])  # the whole dataset, as written
    scores = selection_scores(train, dataset, train_weight=0.5)
    # 0.5 * (6/8, 0, 2/8, 0, 0) + 0.5 * (10/100, 0, 0, 30/100, 60/100) per id
    assert scores.tolist() == pytest.approx([0, 0.425, 0, 0.125, 0.15, 0.3, 0])
    d2t, t2d = build_draft_vocab(scores, draft_vocab_size=3)
    assert (torch.arange(3) + d2t).tolist() == [1, 4, 5]  # 4 and 5 never occur in the train split
    assert coverage(dataset, t2d) == 1.0 and coverage(train, t2d) == 0.75
    assert selection_scores(train, None, 0.5).tolist() == pytest.approx((train / 8).tolist())
    # a drafter of another size is cut from the same ranking, and the saved ranking round-trips
    save_draft_vocab(tmp_path / "v.safetensors", d2t, t2d, train, dataset, scores)
    d2t2, t2d2 = draft_vocab_of_size(tmp_path / "v.safetensors", 4)
    assert t2d2.nonzero().flatten().tolist() == [1, 3, 4, 5]
    assert draft_vocab_of_size(tmp_path / "v.safetensors", 3)[1].tolist() == t2d.tolist()
