"""Dialogues to token ids plus a loss mask that is 1 on assistant tokens only.

Drafters learn to predict what the target *answers*, so every assistant turn of
a multi-turn dialogue is in the loss and nothing else is (system prompts, user
turns and template headers are context).

Two ways to find the assistant tokens:
  * the template marks answers with ``{% generation %}...{% endgeneration %}``:
    transformers returns the mask (``return_assistant_tokens_mask=True``);
  * otherwise: render the dialogue up to each answer (with the generation
    prompt) and up to its end; the characters in between are the answer, and
    the tokenizer's offsets say which tokens cover them. Working in characters,
    not in token counts of separately tokenized prefixes, stays right when BPE
    merges across a turn boundary.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import SpecdraftError

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


def resolve_chat_template(tokenizer, override: str | None = None) -> str:
    """The template text: ``override`` (a file path or inline jinja) or the tokenizer's own."""
    if override:
        if "{{" in override or "{%" in override:
            return override
        path = Path(override).expanduser()
        if path.is_file():
            return path.read_text()
        raise SpecdraftError(
            f"data.chat_template={override!r} is neither an existing file nor a jinja template. "
            "Give the path of a .jinja file or the template text itself."
        )
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: use the default one
        template = template.get("default")
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise SpecdraftError(
            f"the tokenizer {name!r} has no chat template, and chat data needs one. Set data.chat_template in "
            "the recipe to a jinja file or inline template (best with {% generation %} markers around answers)."
        )
    return template


def has_generation_markers(template: str) -> bool:
    return GENERATION_MARKER.search(template) is not None


def render(messages: list[dict], tokenizer, template: str, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def tokenize_dialogue(messages: list[dict], tokenizer, template: str) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of one dialogue; ``loss_mask`` is 1 on assistant tokens."""
    if has_generation_markers(template):
        out = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
    return assistant_mask_from_prefixes(messages, tokenizer, template)


def assistant_mask_from_prefixes(messages: list[dict], tokenizer, template: str) -> tuple[list[int], list[int]]:
    """The fallback for templates without generation markers (see the module docstring)."""
    full = render(messages, tokenizer, template)
    spans = []  # [start, end) character range of each answer in `full`
    for i, message in enumerate(messages):
        # An opening assistant greeting has no prompt to render before it; leave it out of the loss.
        if message["role"] != "assistant" or i == 0:
            continue
        before = render(messages[:i], tokenizer, template, add_generation_prompt=True)
        through = render(messages[: i + 1], tokenizer, template)
        # Templates that rewrite earlier turns (e.g. drop past reasoning) break the prefix property.
        if not (through.startswith(before) and full.startswith(through)):
            raise SpecdraftError(
                "the chat template renders earlier turns differently once later turns are added, so the "
                "assistant tokens cannot be found by rendering prefixes. Set data.chat_template to a template "
                "with {% generation %}...{% endgeneration %} around each assistant answer."
            )
        spans.append((len(before), answer_end(through, len(before), tokenizer.eos_token)))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    # A token is an answer token if it starts inside an answer span.
    mask = [int(any(start <= t < end for start, end in spans)) for t, _ in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


def answer_end(rendered: str, start: int, eos_token: str | None) -> int:
    """Where an answer that starts at ``start`` and runs to the end of ``rendered`` really ends.

    The target stops at its end-of-turn token, so white space a template writes after it (ChatML's
    ``<|im_end|>\n``) is never generated and is no label: the answer ends right after that token.
    """
    end = len(rendered)
    cut = rendered.rfind(eos_token, start) if eos_token else -1
    if cut >= 0 and not rendered[cut + len(eos_token):].strip():
        end = cut + len(eos_token)
    return end


def tokenize_text(text: str, tokenizer) -> tuple[list[int], list[int]]:
    """Plain text: every token is in the loss (with the tokenizer's usual BOS, if any)."""
    input_ids = list(tokenizer(text)["input_ids"])
    return input_ids, [1] * len(input_ids)
