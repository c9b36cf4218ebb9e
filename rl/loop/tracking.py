"""Run logging: metrics.jsonl (one object per step), TensorBoard, optional W&B, a progress bar."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(self, output_dir: str | Path, total_steps: int, *, tensorboard: bool = True,
                 wandb_project: str | None = None, progress_bar: bool = True, config: dict | None = None,
                 start_step: int = 0, desc: str = "rl"):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(self.dir / "tensorboard"))
        self.wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError as exc:
                raise RuntimeError("logging.wandb_project is set but wandb is not installed "
                                   "(pip install 'looprl[wandb]')") from exc
            self.wandb = wandb.init(project=wandb_project, config=config, dir=str(self.dir))
        self.bar = None
        if progress_bar:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, desc=desc, file=sys.stderr,
                            dynamic_ncols=True, mininterval=1.0)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        numeric = {k: v for k, v in clean.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb is not None:
            for k, v in numeric.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(numeric, step=step)
        if self.bar is not None:
            show = {"reward": "reward/mean", "kl": "actor/kl", "tok/s": "perf/tokens_per_s"}
            self.bar.set_postfix({k: f"{numeric[v]:.3g}" for k, v in show.items() if v in numeric}, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(output_dir: str | Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines written after the checkpoint we resume from (they will be produced again)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))
