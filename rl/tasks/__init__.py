"""Synthetic tasks built in code (registry kind `task`, chosen by `data.synthetic.task`): each writes
its SFT, RL and held-out splits as JSONL files and returns their paths. A task is
`fn(out_dir, *, num_train, num_eval, sft_fraction, wrong_order_fraction, seed, **_) -> {split: path}`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_splits(out_dir: str | Path, splits: dict[str, list[dict[str, Any]]], prefix: str = "") -> dict[str, str]:
    """Each split's rows as `out_dir/{prefix}{split}.jsonl`; returns the paths by split."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in splits.items():
        path = out / f"{prefix}{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths[name] = str(path)
    return paths
