import pytest
from tiny import CHAT_TEMPLATE, CHAT_TEMPLATE_NO_MARKERS, tiny_tokenizer

from specdraft.data.chat import (
    assistant_mask_from_prefixes,
    has_generation_markers,
    resolve_chat_template,
    tokenize_dialogue,
    tokenize_text,
)
from specdraft.errors import SpecdraftError

DIALOGUE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "How many legs does a spider have?"},
    {"role": "assistant", "content": "A spider has eight legs."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You are welcome!"},
]
ANSWERS = ["Paris.", "A spider has eight legs.", "You are welcome!"]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def masked_text(tokenizer, input_ids, loss_mask):
    return tokenizer.decode([t for t, m in zip(input_ids, loss_mask) if m])


def test_marker_detection():
    assert has_generation_markers(CHAT_TEMPLATE)
    assert has_generation_markers("{%- generation -%}x{%- endgeneration -%}")
    assert not has_generation_markers(CHAT_TEMPLATE_NO_MARKERS)


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, CHAT_TEMPLATE_NO_MARKERS], ids=["markers", "prefixes"])
def test_loss_on_every_assistant_turn_and_nothing_else(tokenizer, template):
    input_ids, loss_mask = tokenize_dialogue(DIALOGUE, tokenizer, template)
    assert len(input_ids) == len(loss_mask)
    assert set(loss_mask) == {0, 1}
    # Exactly the three answers, each with the <|eos|> that ends it (so the drafter learns to stop).
    assert masked_text(tokenizer, input_ids, loss_mask) == "".join(a + "<|eos|>" for a in ANSWERS)
    full = tokenizer.apply_chat_template(DIALOGUE, chat_template=template, tokenize=True, return_dict=True)
    assert input_ids == list(full["input_ids"])


def test_prefix_fallback_equals_generation_markers(tokenizer):
    for n in (3, 5, 7):
        assert assistant_mask_from_prefixes(DIALOGUE[:n], tokenizer, CHAT_TEMPLATE_NO_MARKERS) == tokenize_dialogue(
            DIALOGUE[:n], tokenizer, CHAT_TEMPLATE
        )


def test_prefix_fallback_refuses_templates_that_rewrite_history(tokenizer):
    # Earlier answers are elided once a later turn exists (as reasoning templates do with past thoughts).
    elide_past = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n"
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}<|end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    with pytest.raises(SpecdraftError, match="generation"):
        tokenize_dialogue(DIALOGUE[:5], tokenizer, elide_past)


def test_plain_text_is_all_loss(tokenizer):
    input_ids, loss_mask = tokenize_text("Once upon a time", tokenizer)
    assert tokenizer.decode(input_ids) == "Once upon a time"
    assert loss_mask == [1] * len(input_ids)


def test_no_chat_template_names_the_fix():
    with pytest.raises(SpecdraftError, match="has no chat template.*Set data.chat_template"):
        resolve_chat_template(tiny_tokenizer(chat_template=None))


def test_template_override_inline_or_file(tokenizer, tmp_path):
    assert resolve_chat_template(tokenizer, CHAT_TEMPLATE_NO_MARKERS) == CHAT_TEMPLATE_NO_MARKERS
    path = tmp_path / "chat.jinja"
    path.write_text(CHAT_TEMPLATE_NO_MARKERS)
    assert resolve_chat_template(tokenizer, str(path)) == CHAT_TEMPLATE_NO_MARKERS
    assert resolve_chat_template(tokenizer, None) == CHAT_TEMPLATE
    with pytest.raises(SpecdraftError, match="neither an existing file nor a jinja template"):
        resolve_chat_template(tokenizer, str(tmp_path / "missing.jinja"))
