"""data_prep.chat: the assistant-only loss mask under real chat templates.

The core property, for ChatML (SmolLM2), Llama-3.1, Qwen3 and gpt-oss Harmony, on a small trained
BPE tokenizer and on the real SmolLM2 tokenizer: decoding exactly the masked tokens of each turn
gives back exactly the assistant text as the template rendered it, plus its end-of-turn token, and
nothing of the system/user turns or role headers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from text_fixtures import (
    CONTROL_TOKENS,
    TEMPLATE_NAMES,
    masked_runs,
    smollm2_tokenizer,
    template,
    tiny_tokenizer,
)

from data_prep.chat import (
    Dropped,
    RenderedSample,
    end_of_turn,
    render_conversation,
    render_prompt,
    template_hash,
)
from data_prep.conversations import Message

CONV = [
    Message("system", "You are a helpful assistant."),
    Message("user", "Hello there!"),
    Message("assistant", "Hi! How are you today?\n", reasoning="The user greets me."),
    Message("user", "What is the capital of France?"),
    Message("assistant", "The capital of France is Paris.", reasoning="Let me think step by step."),
]

# What each template renders for the two assistant turns, from the generation prompt on, with the
# end of turn. Reasoning: ChatML/Llama ignore it, Qwen3 and gpt-oss keep it for the last turn only.
EXPECTED = {
    "chatml_smollm2": ["Hi! How are you today?\n<|im_end|>", "The capital of France is Paris.<|im_end|>"],
    "llama3_1": ["Hi! How are you today?<|eot_id|>", "The capital of France is Paris.<|eot_id|>"],
    "qwen3": [
        "Hi! How are you today?\n<|im_end|>",
        "<think>\nLet me think step by step.\n</think>\n\nThe capital of France is Paris.<|im_end|>",
    ],
    "gpt_oss": [
        "<|channel|>final<|message|>Hi! How are you today?\n<|end|>",
        "<|channel|>analysis<|message|>Let me think step by step.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>The capital of France is Paris.<|return|>",
    ],
}
NOT_TRAINED = ["You are a helpful assistant.", "Hello there!", "What is the capital of France?"]


def decode(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("smollm2")
    smollm2_tokenizer(path)  # the slow GGUF load happens once; later loads read the saved files
    return path


@pytest.fixture
def smol(smol_dir):
    return smollm2_tokenizer(smol_dir)


def with_template(tok, name: str):
    """The real SmolLM2 tokenizer taught the control tokens of the other templates."""
    from tokenizers import AddedToken

    missing = [t for t in CONTROL_TOKENS if t not in tok.get_vocab()]
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in missing], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.chat_template = template(name)
    return tok


def check_mask(tok, sample: RenderedSample, expected: list[str], not_trained=tuple(NOT_TRAINED)) -> None:
    assert isinstance(sample, RenderedSample), sample
    assert len(sample.input_ids) == len(sample.loss_mask) and not sample.truncated
    runs = masked_runs(sample.input_ids, sample.loss_mask)
    assert [decode(tok, r) for r in runs] == sample.assistant_texts == expected
    unmasked = decode(tok, [t for t, m in zip(sample.input_ids, sample.loss_mask) if not m])
    for text in not_trained:
        assert text in unmasked
    assert "Paris" not in unmasked and "How are you" not in unmasked
    # everything outside the assistant spans, in order, is the rest of the rendering
    full = decode(tok, sample.input_ids)
    rest = full
    for text in expected:
        rest = rest.replace(text, "", 1)
    assert unmasked == rest


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_mask_is_exactly_the_rendered_assistant_turns_tiny_bpe(name: str) -> None:
    tok = tiny_tokenizer(name)
    check_mask(tok, render_conversation(tok, CONV, max_len=4096), EXPECTED[name])


@pytest.mark.integration
@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_mask_is_exactly_the_rendered_assistant_turns_smollm2(smol, name: str) -> None:
    tok = with_template(smol, name)
    check_mask(tok, render_conversation(tok, CONV, max_len=4096), EXPECTED[name])


@pytest.mark.integration
def test_smollm2_own_template_from_gguf(smol) -> None:
    tok = smol  # chat template as shipped in the GGUF
    sample = render_conversation(tok, CONV[1:], max_len=4096)  # no system: the template adds its own
    assert decode(tok, sample.input_ids).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
    )
    check_mask(tok, sample, EXPECTED["chatml_smollm2"], not_trained=NOT_TRAINED[1:] + ["named SmolLM"])
    assert end_of_turn(tok) == "<|im_end|>"


@pytest.mark.integration
def test_token_crossing_the_turn_start(smol) -> None:
    """SmolLM2 merges the header's newline with leading spaces of the reply into one token: that
    token is trained (its part before the turn is whitespace), assistant_texts keeps the template's span."""
    tok = with_template(smol, "chatml_smollm2")
    s = render_conversation(tok, [Message("user", "Hi"), Message("assistant", "  indented")], max_len=64)
    assert s.assistant_texts == ["  indented<|im_end|>"]
    assert [decode(tok, r) for r in masked_runs(s.input_ids, s.loss_mask)] == ["\n  indented<|im_end|>"]


def test_qwen3_thinking_switch_moves_the_empty_think_block() -> None:
    tok = tiny_tokenizer("qwen3")
    plain = [Message("user", "Hello there!"), Message("assistant", "Hi!")]
    on = render_conversation(tok, plain, max_len=512)
    off = render_conversation(tok, plain, max_len=512, template_kwargs={"enable_thinking": False})
    # same tokens; thinking on: the model writes the empty think block, off: the prompt holds it
    assert on.input_ids == off.input_ids
    assert on.assistant_texts == ["<think>\n\n</think>\n\nHi!<|im_end|>"]
    assert off.assistant_texts == ["Hi!<|im_end|>"]
    assert decode(tok, render_prompt(tok, plain[:1], template_kwargs={"enable_thinking": False})).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # inline reasoning of an earlier turn is stripped by the template, so it is not trained
    inline = [
        plain[0],
        Message("assistant", "<think>hmm</think>\n\nHi!"),
        Message("user", "Bye"),
        Message("assistant", "Ciao"),
    ]
    s = render_conversation(tok, inline, max_len=512, template_kwargs={"enable_thinking": False})
    assert s.assistant_texts == ["Hi!<|im_end|>", "Ciao<|im_end|>"]
    assert [decode(tok, r) for r in masked_runs(s.input_ids, s.loss_mask)] == s.assistant_texts


def test_mistral_template_without_generation_prompt_uses_fallbacks() -> None:
    tok = tiny_tokenizer("mistral_v3")
    tok.bos_token, tok.eos_token = "<s>", "</s>"
    s = render_conversation(tok, CONV, max_len=4096)
    assert s.assistant_texts == ["Hi! How are you today?</s>", "The capital of France is Paris.</s>"]
    # the space the template puts before the reply belongs to the first reply token ("Ġ...")
    assert [decode(tok, r).lstrip(" ") for r in masked_runs(s.input_ids, s.loss_mask)] == s.assistant_texts
    assert end_of_turn(tok) == "</s>"
    bad = [Message("user", "a"), Message("user", "b"), Message("assistant", "c")]
    assert render_conversation(tok, bad, max_len=64).reason == "template_error"


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_end_of_turn_and_prompt(name: str) -> None:
    tok = tiny_tokenizer(name)
    assert (
        end_of_turn(tok)
        == {
            "chatml_smollm2": "<|im_end|>",
            "llama3_1": "<|eot_id|>",
            "qwen3": "<|im_end|>",
            "gpt_oss": "<|return|>",
        }[name]
    )
    full = decode(tok, render_conversation(tok, CONV, max_len=4096).input_ids)
    prompt = decode(tok, render_prompt(tok, CONV[:4]))
    gen = {
        "chatml_smollm2": "<|im_start|>assistant\n",
        "llama3_1": "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "qwen3": "<|im_start|>assistant\n",
        "gpt_oss": "<|start|>assistant",
    }[name]
    assert prompt.endswith(gen) and full.startswith(prompt)


def test_truncation_and_drop() -> None:
    tok = tiny_tokenizer("chatml_smollm2")
    whole = render_conversation(tok, CONV, max_len=4096)
    n = len(whole.input_ids)
    last_run_start = max(i for i, m in enumerate(whole.loss_mask) if m and not whole.loss_mask[i - 1])
    cut = last_run_start + 3  # inside the second assistant turn
    t = render_conversation(tok, CONV, max_len=cut)
    assert t.truncated and t.full_length == n and not whole.truncated
    assert t.input_ids == whole.input_ids[:cut] and t.loss_mask == whole.loss_mask[:cut]
    assert sum(t.loss_mask) == sum(whole.loss_mask[:cut]) > 0
    d = render_conversation(tok, CONV, max_len=cut, overflow="drop")
    assert isinstance(d, Dropped) and d.reason == "too_long"
    assert render_conversation(tok, CONV, max_len=n, overflow="drop").input_ids == whole.input_ids
    first = whole.loss_mask.index(1)
    assert render_conversation(tok, CONV, max_len=first).reason == "no_assistant_tokens"


def test_long_text_prefix_tokenization_matches_full() -> None:
    tok = tiny_tokenizer("chatml_smollm2")
    long = [Message("user", "Tell me a story."), Message("assistant", "The quick brown fox jumps. " * 400)]
    s = render_conversation(tok, long, max_len=200)
    assert s.truncated and s.full_length is None  # only a prefix was tokenized
    full_ids = tok(
        tok.apply_chat_template([m.to_dict() for m in long], tokenize=False), add_special_tokens=False
    )["input_ids"]
    assert s.input_ids == full_ids[:200]
    assert s.loss_mask == [0] * s.loss_mask.index(1) + [1] * (200 - s.loss_mask.index(1))


def test_control_tokens_in_text_and_bad_inputs() -> None:
    tok = tiny_tokenizer("chatml_smollm2")
    forged = [Message("user", "say <|im_end|> now"), Message("assistant", "ok")]
    assert render_conversation(tok, forged, max_len=64).reason == "control_token_in_text"
    assert render_conversation(tok, [Message("user", "hi")], max_len=64).reason == "no_assistant"
    with pytest.raises(ValueError):
        render_conversation(tok, CONV, max_len=64, overflow="wrap")
    with pytest.raises(ValueError):  # a tokenizer without any chat template is a setup error
        render_conversation(tiny_tokenizer(None), CONV, max_len=64)
    dicts = [m.to_dict() for m in CONV]  # plain dicts work as well as Message objects
    assert render_conversation(tok, dicts, max_len=4096) == render_conversation(tok, CONV, max_len=4096)


def test_template_hash() -> None:
    a, b = tiny_tokenizer("chatml_smollm2"), tiny_tokenizer("chatml_smollm2")
    assert template_hash(a) == template_hash(b) and len(template_hash(a)) == 16
    assert template_hash(a) != template_hash(tiny_tokenizer("qwen3"))
    assert template_hash(a, chat_template=template("qwen3")) == template_hash(tiny_tokenizer("qwen3"))
