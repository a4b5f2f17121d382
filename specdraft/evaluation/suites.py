"""Prompt suites for ``specdraft eval``: what the decoders are asked to answer or continue.

A suite is one file or folder; its name is the file's stem. Each JSONL record is one of:
  question  {"question_id", "category", "turns": [str, ...]}   (Spec-Bench / MT-bench format)
            answered turn by turn through the chat template, each answer fed back
  prompt    {"prompt": str, "category"?: str}  a single user turn through the chat template
            (the raw text, if the tokenizer has no chat template)
  text      {"text": str, "category"?: str}    a held-out document: its first ``prefix_tokens``
            tokens are continued verbatim, no template
A folder is read as held-out code: every ``*.py`` file below it is a text prefix (category "code").
``heldout_prompts`` makes "tokens" prompts from training's held-out samples: each sample's own ids up to its
first answer token, decoded as they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdraft.errors import SpecdraftError

QUESTION_FIELDS = ("question_id", "category", "turns")


@dataclass
class Prompt:
    id: str
    suite: str
    category: str
    kind: str  # "question" | "prompt" | "text" | "tokens"
    turns: list[str]  # the user turns; one entry for "prompt" and "text" (and a label for "tokens")
    ids: list[int] | None = None  # "tokens": the prompt, already tokenized


HELDOUT_PREFIX_TOKENS = 128  # a held-out sample that is all answer (plain text) is continued after this many


def heldout_prompts(samples, count: int) -> list[Prompt]:
    """Up to ``count`` held-out training samples, spread evenly, each cut before its first answer token (a
    sample of plain text, every token an answer, after ``HELDOUT_PREFIX_TOKENS``): the data's own kind of
    prompt, never trained on. ``samples`` has ``input_ids`` and ``loss_mask`` per row, as the pipeline's."""
    n = len(samples)
    picks = sorted({i * n // count for i in range(count)}) if n > count else range(n)
    prompts = []
    for i in picks:
        ids, mask = list(samples[i]["input_ids"]), list(samples[i]["loss_mask"])
        first = mask.index(1) if 1 in mask else len(ids)
        cut = first or min(HELDOUT_PREFIX_TOKENS, len(ids) // 2)
        if cut >= 1:
            prompts.append(Prompt(f"heldout-{i}", "heldout", "heldout", "tokens", [f"held-out sample {i}"], ids[:cut]))
    return prompts


def load_suite(path: str | Path, num_prompts: int | None = None) -> list[Prompt]:
    """Read a suite; with ``num_prompts``, keep that many spread evenly over the file (so every category shows up)."""
    path = Path(path)
    if path.is_dir():
        prompts = _read_code_folder(path)
    elif path.is_file():
        prompts = _read_jsonl(path)
    else:
        raise SpecdraftError(f"prompt suite {path} does not exist; pass a .jsonl file or a folder of .py files.")
    if not prompts:
        raise SpecdraftError(
            f"prompt suite {path} is empty; it needs JSONL records with `turns`, `prompt` or `text`, "
            "or (for a folder) non-empty .py files."
        )
    if num_prompts is not None and num_prompts < len(prompts):
        if num_prompts < 1:
            raise SpecdraftError(f"--num-prompts must be >= 1, got {num_prompts}.")
        prompts = [prompts[i * len(prompts) // num_prompts] for i in range(num_prompts)]
    return prompts


def prompt_token_ids(tokenizer, prompt: Prompt, answers: list[str] = (), prefix_tokens: int = 128) -> list[int]:
    """Token ids of the next turn to generate: after ``len(answers)`` answered turns."""
    if prompt.kind == "tokens":
        return list(prompt.ids)
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if prompt.kind == "question" and not has_template:
        raise SpecdraftError(
            f"question {prompt.id!r} of suite {prompt.suite!r} is a chat prompt but the target's tokenizer has "
            "no chat template; evaluate a chat model, or use a JSONL of `text` prefixes for a base model."
        )
    if prompt.kind == "text":
        # A token is rarely over 16 characters: no need to tokenize the whole document.
        return tokenizer(prompt.turns[0][: 16 * prefix_tokens])["input_ids"][:prefix_tokens]
    if not has_template:
        return tokenizer(prompt.turns[0])["input_ids"]
    messages = []
    for turn, answer in zip(prompt.turns, [*answers, None]):
        messages.append({"role": "user", "content": turn})
        if answer is None:
            break
        messages.append({"role": "assistant", "content": answer})
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


def _read_jsonl(path: Path) -> list[Prompt]:
    prompts = []
    # split("\n"): splitlines() would also cut at a U+2028 inside a JSON string
    for line_number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {line_number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecdraftError(f"{where} is not valid JSON ({e}); write one JSON object per line.") from e
        if not isinstance(record, dict):
            raise SpecdraftError(f"{where} is a {type(record).__name__}, not a JSON object.")
        prompts.append(_parse_record(record, where, path.stem, line_number))
    return prompts


def _parse_record(record: dict, where: str, suite: str, line_number: int) -> Prompt:
    if "turns" in record or "question_id" in record:
        missing = [f for f in QUESTION_FIELDS if f not in record]
        if missing:
            raise SpecdraftError(
                f"{where} looks like a Spec-Bench/MT-bench question but lacks {missing}; each question needs "
                f"{list(QUESTION_FIELDS)} (turns = a list of user messages)."
            )
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise SpecdraftError(f"{where}: `turns` must be a non-empty list of non-empty strings, got {turns!r:.80}.")
        return Prompt(str(record["question_id"]), suite, str(record["category"]), "question", list(turns))
    for kind in ("prompt", "text"):
        if kind in record:
            if not isinstance(record[kind], str) or not record[kind].strip():
                raise SpecdraftError(f"{where}: `{kind}` must be a non-empty string.")
            category = str(record.get("category", kind))
            return Prompt(str(record.get("id", line_number)), suite, category, kind, [record[kind]])
    raise SpecdraftError(
        f"{where} has fields {sorted(record)}; expected a question ({', '.join(QUESTION_FIELDS)}), "
        "or a `prompt` or `text` field."
    )


def _read_code_folder(folder: Path) -> list[Prompt]:
    prompts = []
    for file in sorted(folder.rglob("*.py")):
        text = file.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            prompts.append(Prompt(str(file.relative_to(folder)), folder.name, "code", "text", [text]))
    return prompts
