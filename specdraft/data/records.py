"""Local data files without the ``datasets`` package: the few ``Dataset`` operations specdraft uses.

specdraft reads data through Hugging Face ``datasets`` (its cache, ``num_proc`` workers, folders and hub
ids). Where ``datasets`` is not installed (a locked-down GPU image, say), a local .json, .jsonl or .parquet
file is read into ``Records`` instead: a list of dicts with the methods that ``build_datasets``, the draft
vocabulary and the training loop call (``select``, ``map``, column access, ``add_column``,
``remove_columns``). The records, their order and the tokenized samples are the same on both paths
(tests/test_data_records.py); what is missing is the cache (every run tokenizes again) and the workers.
A folder or a hub id still needs ``datasets``, and the error says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import SpecdraftError

INSTALL = "pip install datasets"


class Records:
    """Rows of a dataset as plain dicts, every row holding every column (missing fields are None, as
    ``datasets`` fills them when it unifies a JSON file's schema)."""

    def __init__(self, rows: list[dict]):
        columns = list(dict.fromkeys(key for row in rows for key in row))
        self.rows = [row if len(row) == len(columns) else {c: row.get(c) for c in columns} for row in rows]
        self.column_names = columns

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, key: int | str):
        """A row by index, or a column (a list) by name, as ``datasets.Dataset`` indexes."""
        if isinstance(key, str):
            return [row[key] for row in self.rows]
        return self.rows[key]

    def __iter__(self):
        return iter(self.rows)

    def select(self, indices) -> Records:
        return Records([self.rows[int(i)] for i in indices])

    def map(self, function, remove_columns=None, features=None, num_proc=None, desc=None,
            with_indices: bool = False) -> Records:
        """``function(row) -> dict`` of new or replaced columns (``function(row, index)`` with ``with_indices``), in
        this process (``features`` and ``num_proc`` are ``datasets``' and ignored: the functions return Python ints
        and strings either way)."""
        dropped = set(remove_columns or ())
        return Records([{**{k: v for k, v in row.items() if k not in dropped},
                         **(function(row, index) if with_indices else function(row))}
                        for index, row in enumerate(self.rows)])

    def remove_columns(self, names: list[str]) -> Records:
        return Records([{k: v for k, v in row.items() if k not in names} for row in self.rows])

    def add_column(self, name: str, values: list) -> Records:
        return Records([{**row, name: value} for row, value in zip(self.rows, values, strict=True)])

    def to_list(self) -> list[dict]:
        return list(self.rows)

    def token_arrays(self, column: str) -> np.ndarray:
        """Every row's list in ``column``, concatenated (what ``datasets`` flattens from arrow)."""
        lists = [np.asarray(row[column], dtype=np.int64) for row in self.rows]
        return np.concatenate(lists) if lists else np.zeros(0, dtype=np.int64)


def read_local_file(path: Path) -> Records:
    """A .jsonl (one record a line), .json (a list of records, or JSON lines) or .parquet file as ``Records``."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # optional: pyarrow (with datasets)
        except ImportError as e:
            raise SpecdraftError(f"reading {path} needs pyarrow or datasets: {INSTALL}") from e
        return Records(pq.read_table(path).to_pylist())
    text = path.read_text(encoding="utf-8")
    if suffix == ".json" and text.lstrip().startswith("["):
        rows = json.loads(text)
    else:  # JSON lines; split("\n"), not splitlines(): a record may hold U+2028
        rows = []
        for number, line in enumerate(text.split("\n"), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SpecdraftError(f"{path}:{number} is not valid JSON ({e}). Fix or drop that line.") from e
    other = next((row for row in rows if not isinstance(row, dict)), None)
    if other is not None:
        raise SpecdraftError(f"{path} must hold JSON objects, one record each; it holds a {type(other).__name__}")
    return Records(rows)
