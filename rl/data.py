"""Dataset loading through `datasets`: JSONL/JSON, Parquet, CSV files and `load_from_disk` folders.

Errors name the recipe key, the file and, for a bad row, its number counted from 1 as an editor counts lines (a
JSONL file's row N is its line N): text that is not UTF-8, a line that is not JSON or not a JSON object, a column
whose value changes type between rows. With `bad_rows: drop` (`data.bad_rows`, `sft.bad_rows`) such rows of a
JSONL file are skipped and counted by reason instead.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

from rl.config import ConfigError
from rl.registry import register


def _json_type(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}[type(value)]


def read_json_lines(path: str, key: str, bad_rows: str = "error", dropped: Counter | None = None) -> list[dict]:
    """The rows of a JSONL file, each checked: UTF-8 text, a JSON object, every column of one JSON type across rows.
    The first bad row raises one `ConfigError` naming `key`, the file and the row (from 1), or with
    `bad_rows: drop` is skipped and counted in `dropped` by reason. Blank lines are skipped."""
    rows: list[dict] = []
    types: dict[str, tuple[str, int]] = {}  # column -> (its type, the row that set it)
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                row = _parse_line(raw, types, number)
            except ValueError as bad:
                if bad_rows != "drop":
                    raise ConfigError(f"{key}: dataset {path!r} row {number}: {bad} (bad_rows: drop skips such "
                                      f"rows)") from None
                if dropped is not None:
                    dropped[str(bad).split(":")[0]] += 1
                continue
            if row is not None:
                rows.append(row)
    return rows


def _decode(raw: bytes) -> str:
    """A line of a text file; `ValueError` naming its first byte that is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8: byte {exc.start + 1} is {raw[exc.start:exc.start + 1]!r}") from None


def _parse_line(raw: bytes, types: dict[str, tuple[str, int]], number: int) -> dict | None:
    """One JSONL line as a row (None for a blank line); `ValueError('reason: detail')` for a bad one."""
    text = _decode(raw)
    if not text.strip():
        return None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(row, dict):
        raise ValueError(f"not a JSON object: a {_json_type(row) or 'null'}")
    for column, value in row.items():
        kind = _json_type(value)
        seen = types.get(column)
        if kind is not None and seen is not None and seen[0] != kind:
            raise ValueError(f"wrong type: column {column!r} is a {kind}, a {seen[0]} in row {seen[1]}")
    for column, value in row.items():  # only a good row sets the types later rows must have
        if (kind := _json_type(value)) is not None and column not in types:
            types[column] = (kind, number)
    return row


def _check_utf8(path: Path, key: str) -> None:
    """A text file's first line that is not UTF-8, named (CSV and JSON files; JSONL rows are read one by one)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                _decode(raw)
            except ValueError as bad:
                raise ConfigError(f"{key}: dataset {str(path)!r} line {number}: {bad}") from None


def _check_json(path: Path, key: str) -> None:
    """A JSON file's syntax error, named by line and column."""
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{key}: dataset {str(path)!r} line {exc.lineno}: not JSON: {exc.msg} at column "
                          f"{exc.colno}") from None


def open_dataset(path: str, key: str, bad_rows: str = "error", dropped: Counter | None = None) -> Any:
    """The `datasets.Dataset` at `path` (JSONL/JSON/Parquet/CSV or a `load_from_disk` folder), non-empty; errors
    name the recipe `key`, and the row where there is one (`bad_rows`, `dropped`: see `read_json_lines`)."""
    import datasets

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{key}: dataset {path!r} does not exist")
    if p.is_file() and p.stat().st_size == 0:  # `datasets` fails on an empty file with a bare StopIteration
        raise ConfigError(f"{key}: dataset {path!r} is empty")
    datasets.disable_progress_bars()
    try:
        if p.is_dir():
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
        else:
            suffix = p.suffix.lower()
            builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(suffix)
            if builder is None:
                raise ConfigError(f"{key}: {path!r} has an unsupported extension {suffix!r} "
                                  f"(use .jsonl, .json, .parquet, .csv or a load_from_disk folder)")
            ds = _load_file(p, suffix, builder, key, bad_rows, dropped)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{key}: cannot read dataset {path!r}: {type(exc).__name__}: {exc}") from None
    if len(ds) == 0:
        raise ConfigError(f"{key}: dataset {path!r} is empty")
    return ds


def _load_file(p: Path, suffix: str, builder: str, key: str, bad_rows: str, dropped: Counter | None) -> Any:
    import datasets
    if suffix == ".jsonl":  # read row by row, so that a bad row is named (or dropped) rather than a pyarrow error
        rows = read_json_lines(str(p), key, bad_rows, dropped)
        return datasets.Dataset.from_list(rows)
    if suffix in (".csv", ".json"):
        _check_utf8(p, key)
    if suffix == ".json":
        _check_json(p, key)
    return datasets.load_dataset(builder, data_files=str(p), split="train")


def load_rows(path: str, columns: list[str], key: str, dataset: Any = None, bad_rows: str = "error",
              dropped: Counter | None = None) -> list[dict[str, Any]]:
    """Load `path` (or use its already opened `dataset`) and return rows restricted to `columns` (all must
    exist, the set must be non-empty). A row with an empty column is named (rows count from 1), or dropped and
    counted with `bad_rows: drop`: into `dropped` when the caller collects the counts (and reports them), else
    reported here."""
    report, dropped = dropped is None, Counter() if dropped is None else dropped
    ds = dataset if dataset is not None else open_dataset(path, key, bad_rows, dropped)
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise ConfigError(f"{key}: dataset {path!r} has no column(s) {missing}; "
                          f"its columns are {ds.column_names}")
    rows, kept = ds.select_columns(columns).to_list(), []
    for i, row in enumerate(rows, start=1):
        empty = [c for c in columns if row[c] is None]
        if empty and bad_rows != "drop":
            raise ConfigError(f"{key}: dataset {path!r} row {i}: column {empty[0]!r} is empty (bad_rows: drop "
                              f"skips such rows)")
        if empty:
            dropped["empty_column"] += 1
            continue
        kept.append(row)
    if not kept:
        raise ConfigError(f"{key}: dataset {path!r} has no usable row")
    if report and dropped:
        print(f"[looprl] {key}: {sum(dropped.values())} bad row(s) of {path!r} dropped ({dict(dropped)})", flush=True)
    return kept


def format_prompt(text: str, tokenizer: Any, prefix: str = "", chat_template: bool = False) -> str:
    """Prompt string given to the engine: optional prefix, optionally wrapped in the chat template."""
    text = prefix + str(text)
    if chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return text


class PromptSampler:
    """Seeded epoch-wise shuffling of prompt indices (`shuffle=False`: the file's order every epoch, for data an
    ordering stage arranged); its state is two integers (checkpointed)."""

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True):
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self.epoch, self.pos = 0, 0

    def _perm(self) -> list[int]:
        perm = list(range(self.num_rows))
        if self.shuffle:
            random.Random(self.seed * 7919 + self.epoch).shuffle(perm)
        return perm

    def next(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            perm = self._perm()
            take = perm[self.pos:self.pos + (k - len(out))]
            out.extend(take)
            self.pos += len(take)
            if self.pos >= self.num_rows:
                self.epoch, self.pos = self.epoch + 1, 0
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


@register("sampler", "shuffle")
def shuffle_sampler(rows: list[dict], seed: int) -> PromptSampler:
    """`trainer.prompt_sampler: {name: shuffle}` (the default): every row once per epoch, in a seeded order."""
    return PromptSampler(len(rows), seed)


def prompt_row_columns(d: Any) -> list[str]:
    """The columns of a train/eval row under the recipe's `data` section: the prompt, the answer and
    `data.metadata_columns`."""
    return [d.prompt_column, d.answer_column, *d.metadata_columns]
