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


# The dataset-wide count (data_prep/chat.py assistant_token_counts, data_prep/pipeline.py dataset_token_counts):
# batched and cached, it must give the counts of render_conversation's samples counted one by one.

def _conversations(n: int) -> list:
    """`n` distinct conversations: one to three exchanges, a system prompt on some, a reply cut at the generation
    cap, a reply with its generated ids, a forged control token (dropped), a long reply (truncated)."""
    from data_prep.conversations import Conversation, Message

    convs = []
    for i in range(n):
        msgs = [Message("system", "You are a helpful assistant.")] if i % 3 == 0 else []
        for turn in range(1 + i % 3):
            msgs += [Message("user", f"Question {i}.{turn}: what is the capital of France?"),
                     Message("assistant", f"The capital of France is Paris ({i}, {turn}).\n" * (1 + 40 * (i % 7 == 5)),
                             reasoning="Let me think step by step." if turn else None, cut=i % 5 == 1)]
        if i % 11 == 4:
            msgs[-2] = Message("user", "say <|im_end|> now")
        convs.append(Conversation(f"c{i}", msgs, "test"))
    return convs


def _with_generated_ids(tok, conv):
    """`conv` with its last reply's generated ids: the text's own ids, and one split differently (both places)."""
    from data_prep.conversations import Conversation, Message

    last = conv.messages[-1]
    ids = tok(last.content, add_special_tokens=False)["input_ids"]
    return Conversation(conv.id + "g", conv.messages[:-1] + [Message("assistant", last.content, last.reasoning,
                                                                     last.cut, tuple(ids[:-1] + ids[-1:]))], "test")


@pytest.mark.parametrize("name", ["chatml_smollm2", "llama3_1", "qwen3", "gpt_oss", "mistral_v3"])
def test_batched_count_equals_samples_counted_one_by_one(name: str) -> None:
    from text_fixtures import tiny_tokenizer

    from data_prep.chat import Dropped, assistant_token_counts, render_conversation

    tok = tiny_tokenizer(name)
    if name == "mistral_v3":
        tok.bos_token, tok.eos_token = "<s>", "</s>"
    convs = _conversations(40)
    convs += [_with_generated_ids(tok, c) for c in convs[:3]]
    messages = [c.messages for c in convs]
    vocab = len(tok)
    whole = [render_conversation(tok, m, max_len=4096) for m in messages]
    short = max(s.loss_mask.index(1) for s in whole if not isinstance(s, Dropped)) + 20  # headers differ in length
    for max_len in (4096, short):
        for kwargs in ({}, {"enable_thinking": False}) if name == "qwen3" else ({},):
            fast = assistant_token_counts(tok, messages, max_len=max_len, vocab_size=vocab, template_kwargs=kwargs)
            slow = assistant_token_counts(tok, messages, max_len=max_len, vocab_size=vocab, template_kwargs=kwargs,
                                          one_by_one=True)
            assert fast.tolist() == slow.tolist() and fast.sum() > 0, (max_len, kwargs)
            samples = [render_conversation(tok, m, max_len=max_len, template_kwargs=kwargs) for m in messages]
            kept = [s for s in samples if not isinstance(s, Dropped)]
            assert fast.sum() == sum(sum(s.loss_mask) for s in kept)
            if max_len == short:
                assert any(s.truncated for s in kept)
    assert assistant_token_counts(tok, [], max_len=64, vocab_size=vocab).tolist() == [0] * vocab


def test_dataset_count_is_split_by_rank_and_cached(tmp_path, monkeypatch, capsys) -> None:
    from text_fixtures import tiny_tokenizer

    from data_prep.chat import assistant_token_counts
    from data_prep.config import PrepConfig
    from data_prep.pipeline import dataset_token_counts
    from data_prep.targets import resolve_target
    from data_prep.vocab import COUNT_CACHE

    monkeypatch.setenv("DRAFTERS_CACHE", str(tmp_path))
    tok, preset = tiny_tokenizer("chatml_smollm2"), resolve_target("smollm2-135m-instruct")
    convs, vocab = _conversations(150), len(tok)
    cfg = PrepConfig(out=str(tmp_path / "prep"), max_len=64, draft_vocab_count_max=140)
    calls = []

    def count(rank=0, world=1, conversations=convs):
        return dataset_token_counts(cfg, tok, conversations, preset, vocab, rank, world,
                                    alive=lambda: calls.append(rank))

    whole = count()
    reference = assistant_token_counts(tok, [c.messages for c in convs[:140]], max_len=64, vocab_size=vocab,
                                       one_by_one=True)
    assert whole.dtype == torch.int64 and whole.tolist() == reference.tolist()
    assert calls == [0, 0, 0]  # before each 64 conversations: 140 = 64 + 64 + 12
    share0, share1 = count(0, 2), count(1, 2)
    assert torch.equal(share0 + share1, whole) and calls[3:] == [0, 0, 1, 1]  # every world-th conversation
    assert len(list((tmp_path / COUNT_CACHE).glob("*.safetensors"))) == 3

    calls.clear()  # counted before: read back, nothing rendered
    assert torch.equal(count(), whole) and torch.equal(count(1, 2), share1) and calls == []
    changed = list(convs)  # another conversation: another key, counted again
    changed[7] = _with_generated_ids(tok, convs[7])
    recount = assistant_token_counts(tok, [c.messages for c in changed[:140]], max_len=64, vocab_size=vocab,
                                     one_by_one=True)
    assert count(conversations=changed).tolist() == recount.tolist() and calls == [0, 0, 0]
    calls.clear()
    for path in (tmp_path / COUNT_CACHE).glob("*.safetensors"):
        path.write_bytes(b"torn")
    assert torch.equal(count(), whole) and calls == [0, 0, 0]
    assert "unreadable" in capsys.readouterr().err
    calls.clear()
    assert torch.equal(count(), whole) and calls == []  # the torn entry was replaced


@pytest.mark.integration
def test_batched_count_equals_one_by_one_on_the_embedded_dataset(smollm2_dir) -> None:
    """300 conversations of the embedded ShareGPT with the real SmolLM2 tokenizer and template, whole and cut at
    a small max_len (truncated samples, the long-text prefix tokenization)."""
    from transformers import AutoTokenizer

    from data_prep.chat import assistant_token_counts, render_conversation
    from data_prep.conversations import load_conversations

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    convs, _ = load_conversations("sharegpt-embedded", max_records=300)
    messages = [c.messages for c in convs]
    assert sum(len(m) > 2 for m in messages) > 100  # multi-turn ones
    for max_len in (2048, 96):
        fast = assistant_token_counts(tok, messages, max_len=max_len, vocab_size=len(tok))
        slow = assistant_token_counts(tok, messages, max_len=max_len, vocab_size=len(tok), one_by_one=True)
        assert fast.tolist() == slow.tolist() and fast.sum() > 0
    assert sum(getattr(render_conversation(tok, m, max_len=96), "truncated", False) for m in messages[:50]) > 10
