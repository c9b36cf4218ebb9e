"""Dataset loading through `datasets`: JSONL/JSON, Parquet, CSV files and `load_from_disk` folders.

Errors name the recipe key, the file and, for bad rows, the row number.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rl.config import ConfigError
from rl.registry import register


def open_dataset(path: str, key: str) -> Any:
    """The `datasets.Dataset` at `path` (JSONL/JSON/Parquet/CSV or a `load_from_disk` folder), non-empty; errors
    name the recipe `key`."""
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
            ds = datasets.load_dataset(builder, data_files=str(p), split="train")
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{key}: cannot read dataset {path!r}: {type(exc).__name__}: {exc}") from None
    if len(ds) == 0:
        raise ConfigError(f"{key}: dataset {path!r} is empty")
    return ds


def load_rows(path: str, columns: list[str], key: str, dataset: Any = None) -> list[dict[str, Any]]:
    """Load `path` (or use its already opened `dataset`) and return rows restricted to `columns` (all must
    exist, the set must be non-empty)."""
    ds = dataset if dataset is not None else open_dataset(path, key)
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise ConfigError(f"{key}: dataset {path!r} has no column(s) {missing}; "
                          f"its columns are {ds.column_names}")
    rows = ds.select_columns(columns).to_list()
    for i, row in enumerate(rows):
        for c in columns:
            if row[c] is None:
                raise ConfigError(f"{key}: dataset {path!r} row {i}: column {c!r} is empty")
    return rows


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
