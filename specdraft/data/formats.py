"""Load raw records and normalise every supported format to one shape.

Formats (``data.format``), detected from the columns when ``auto``:
  sharegpt  {"conversations": [{"from": "human"|"gpt"|"system"|..., "value": str}]}
  messages  {"messages": [{"role": "user"|"assistant"|"system"|..., "content": str}]}  (OpenAI)
  turns     {"turns": [str, ...]}  user turns only, no answers (Spec-Bench / MT-bench prompts)
  text      {text_field: str}  plain text

Chat formats become ``{"messages": [{"role", "content"}]}`` with roles
system / user / assistant / tool; plain text becomes ``{"text": str}``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import SpecdraftError
from .records import INSTALL, Records, read_local_file

try:
    import datasets
except ImportError:  # optional for local files: they are read into Records (specdraft/data/records.py)
    datasets = None

FORMATS = ("sharegpt", "messages", "turns", "text")
CHAT_COLUMNS = {"sharegpt": "conversations", "messages": "messages", "turns": "turns"}
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}  # suffix -> datasets builder

# ShareGPT dumps use many speaker names; map them onto the chat-template roles.
ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


def check_data_source(path: str) -> None:
    """What can be said of ``path`` without reading it: a local file exists, has a format we read and
    holds records. Called before anything heavy loads, and again by ``load_raw``."""
    local = Path(path).expanduser()
    if local.is_file():
        if FILE_BUILDERS.get(local.suffix.lower()) is None:
            raise SpecdraftError(
                f"cannot read {path!r}: data files must be {' / '.join(FILE_BUILDERS)}. "
                "Convert it, or point data.path at a folder or hub dataset."
            )
        if _has_no_records(local):  # datasets would fail with a bare StopIteration / a split error
            raise SpecdraftError(f"data file {path!r} is empty. Point data.path at a file with records.")
    elif not local.is_dir() and _looks_like_local_path(path):
        raise SpecdraftError(
            f"data file {path!r} does not exist. Fix data.path (relative paths start at the working directory)."
        )


def load_raw(path: str, split: str = "train") -> datasets.Dataset | Records:
    """A local .json/.jsonl/.parquet file or folder, or else a datasets hub id. Without ``datasets``
    installed, a local file is read into ``Records``; a folder or hub id names the install."""
    local = Path(path).expanduser()
    try:
        check_data_source(path)
        if datasets is None:
            if not local.is_file():
                raise SpecdraftError(f"reading {path!r} (a folder or a hub dataset) needs the datasets package: "
                                     f"{INSTALL}. Local .json/.jsonl/.parquet files read without it.")
            dataset = read_local_file(local)
        elif local.is_file():
            check_text_lines(local)
            dataset = datasets.load_dataset(FILE_BUILDERS[local.suffix.lower()], data_files=str(local), split="train")
        elif local.is_dir():
            # datasets' folder loader maps file names (train.jsonl, test-*.parquet, ...) to splits.
            dataset = datasets.load_dataset(str(local), split=split)
        else:
            dataset = datasets.load_dataset(path, split=split)
    except SpecdraftError:
        raise
    except Exception as e:  # datasets raises many types (FileNotFoundError, ValueError, DatasetNotFoundError, ...)
        if local.is_file() and local.suffix.lower() == ".jsonl":
            check_json_lines(local)  # names the first line that is not JSON, if that was the trouble
        raise SpecdraftError(
            f"could not load data {path!r} (split {split!r}): {type(e).__name__}: {e}\n"
            "Give data.path a local .jsonl/.json/.parquet file or folder, or a reachable hub dataset id, "
            "and data.split a split it has."
        ) from e
    if len(dataset) == 0:
        raise SpecdraftError(f"data {path!r} (split {split!r}) has no records. Point data.path at a non-empty dataset.")
    return dataset


def check_text_lines(path: Path) -> None:
    """A .json/.jsonl file is UTF-8 throughout (JSON's encoding), or the error names its first bad line: pyarrow
    would read the bytes and fail later, deep inside a record, naming neither."""
    if path.suffix.lower() not in (".json", ".jsonl"):
        return
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SpecdraftError(f"{path}:{number} is not UTF-8 text (byte {line[e.start]:#04x} at column "
                                     f"{e.start + 1}); JSON files are UTF-8: re-encode the file "
                                     "(e.g. iconv -f latin1 -t utf-8) or drop that line.") from e


def check_json_lines(path: Path) -> None:
    """Raise naming the first line of a JSONL file that is not one JSON value; return if every line is."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    json.loads(line)
                except ValueError as e:
                    raise SpecdraftError(f"{path}:{number} is not valid JSON ({e}); each line of a .jsonl file is "
                                         "one record: fix or drop that line.") from e


def _has_no_records(path: Path) -> bool:
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq  # optional: pyarrow (with datasets), for parquet files only

        return pq.ParquetFile(path).metadata.num_rows == 0
    with open(path, "rb") as f:  # JSON: blank if nothing but whitespace
        for chunk in iter(lambda: f.read(1 << 16), b""):
            if chunk.strip():
                return False
    return True


def _looks_like_local_path(path: str) -> bool:
    # Hub ids look like "org/name"; anything with a file suffix or a path prefix is meant to be local.
    return path.startswith((".", "/", "~")) or Path(path).suffix.lower() in FILE_BUILDERS or path.count("/") > 1


def detect_format(columns: list[str], text_field: str = "text") -> str:
    """The format a dataset with these columns is in, or a SpecdraftError naming the fix."""
    for fmt, column in CHAT_COLUMNS.items():
        if column in columns:
            return fmt
    if text_field in columns:
        return "text"
    raise SpecdraftError(
        f"cannot tell the data format from the columns {sorted(columns)}: expected 'conversations' (ShareGPT), "
        f"'messages' (OpenAI), 'turns' (Spec-Bench / MT-bench) or {text_field!r} (plain text). "
        "Rename the column, or set data.text_field to the column holding plain text."
    )


def resolve_format(fmt: str, columns: list[str], text_field: str = "text") -> str:
    """``data.format`` checked against the columns (``auto`` detects)."""
    if fmt == "auto":
        return detect_format(columns, text_field)
    if fmt not in FORMATS:
        raise SpecdraftError(f"unknown data.format {fmt!r}; use one of auto, {', '.join(FORMATS)}.")
    needed = text_field if fmt == "text" else CHAT_COLUMNS[fmt]
    if needed not in columns:
        raise SpecdraftError(
            f"data.format={fmt} needs a {needed!r} column, but the data has {sorted(columns)}. "
            "Set data.format: auto (or the right format)" + (", or data.text_field." if fmt == "text" else ".")
        )
    return fmt


def _content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        texts = [part.get("text") or "" for part in content if isinstance(part, dict) and part.get("type") == "text"]
        return "".join(texts)
    raise SpecdraftError(f"message content must be a string or a list of text parts, got {type(content).__name__}.")


def to_messages(record: dict, fmt: str, answers_may_be_missing: bool = False) -> list[dict]:
    """One chat record as ``[{"role", "content"}]`` (``fmt`` is sharegpt, messages or turns).

    A message whose content is null is refused (training would read it as an empty message), except an
    assistant's when ``answers_may_be_missing``: ``specdraft regenerate`` writes those."""
    if fmt == "turns":
        if any(turn is None for turn in record["turns"]):
            raise SpecdraftError("a turn is null; give every turn its text, or drop the record")
        return [{"role": "user", "content": _content_text(turn)} for turn in record["turns"]]
    messages = []
    # Both keys are accepted in both formats: many "ShareGPT" dumps actually use role/content.
    for turn in record[CHAT_COLUMNS[fmt]] or []:
        speaker = turn.get("role") or turn.get("from")
        role = ROLE_ALIASES.get(str(speaker).lower())
        if role is None:
            raise SpecdraftError(
                f"unknown speaker {speaker!r} in a {fmt} record; known: {', '.join(sorted(ROLE_ALIASES))}. "
                "Rename it in the data (e.g. to 'user' or 'assistant')."
            )
        content = turn["content"] if turn.get("content") is not None else turn.get("value")
        if content is None and not (role == "assistant" and answers_may_be_missing):
            raise SpecdraftError(
                f"a {role} message has no content (null); give it its text, or drop the record"
                + (" (or run `specdraft regenerate` to write the target's answers)" if role == "assistant" else ""))
        messages.append({"role": role, "content": _content_text(content)})
    return messages


def from_messages(record: dict, fmt: str, messages: list[dict]) -> dict:
    """``record`` rewritten with new message contents, in its own format (turns become messages).

    Used by ``specdraft regenerate``: every field other than the dialogue is kept.
    """
    if fmt == "turns":
        out = {key: value for key, value in record.items() if key != "turns"}
        out["messages"] = [{"role": m["role"], "content": m["content"]} for m in messages]
        return out
    column = CHAT_COLUMNS[fmt]
    turns = record[column]
    if len(turns) != len(messages):
        raise ValueError(f"got {len(messages)} messages for a dialogue of {len(turns)} turns")
    rewritten = []
    for turn, message in zip(turns, messages):
        key = "value" if "value" in turn and "content" not in turn else "content"
        rewritten.append({**turn, key: message["content"]})
    return {**record, column: rewritten}


def normalize(dataset: datasets.Dataset | Records, fmt: str, text_field: str = "text",
              num_proc: int = 1) -> datasets.Dataset | Records:
    """``{"messages": [...]}`` for chat formats, ``{"text": str}`` for plain text."""
    if fmt == "text":
        def convert(record):
            return {"text": _content_text(record[text_field])}
    else:
        def convert(record, index):
            try:
                return {"messages": to_messages(record, fmt)}
            except SpecdraftError as e:
                raise SpecdraftError(f"data record {index} (counting from 0): {e}") from e
    return dataset.map(
        convert,
        with_indices=fmt != "text",
        remove_columns=dataset.column_names,
        num_proc=num_proc if num_proc > 1 else None,
        desc=f"reading {fmt} records",
    )
