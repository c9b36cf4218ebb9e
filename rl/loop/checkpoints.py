"""Checkpoint folders of a run: the newest complete one, pruning, and the checkpoint a held-out metric selected."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any


def latest_checkpoint(output_dir: str | Path, folder: str = "checkpoints") -> Path | None:
    """The newest complete `step_N` checkpoint in `output_dir/folder`."""
    root = Path(output_dir) / folder
    done = [p for p in root.glob("step_*") if (p / "COMPLETE").exists()] if root.exists() else []
    return max(done, key=lambda p: int(p.name.split("_")[1])) if done else None


def prune_checkpoints(root: Path, keep: int) -> None:
    """Keep the `keep` newest complete checkpoints, and the selected one (`best.json`, `trainer.select_by`)."""
    best = selected_checkpoint(root.parent)
    done = sorted((p for p in root.glob("step_*") if (p / "COMPLETE").exists()),
                  key=lambda p: int(p.name.split("_")[1]))
    for p in done[:-keep] if keep > 0 else []:
        if best is None or p.name != best["checkpoint"]:
            shutil.rmtree(p, ignore_errors=True)


def selected_checkpoint(output_dir: str | Path) -> dict[str, Any] | None:
    """The checkpoint `trainer.select_by` chose so far: {checkpoint (folder name), step, metric, value}."""
    path = Path(output_dir) / "checkpoints" / "best.json"
    return json.loads(path.read_text()) if path.exists() else None


def improves(value: float, best: dict[str, Any] | None, mode: str) -> bool:
    """Whether `value` beats the selected checkpoint's (the first evaluation always does; ties keep the earlier)."""
    if best is None:
        return True
    return value > best["value"] if mode == "max" else value < best["value"]
