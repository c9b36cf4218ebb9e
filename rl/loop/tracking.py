"""Run logging: metrics.jsonl (one object per step), TensorBoard, optional W&B and MLflow, a progress bar."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(self, output_dir: str | Path, total_steps: int, *, tensorboard: bool = True,
                 wandb_project: str | None = None, progress_bar: bool = True, config: dict | None = None,
                 start_step: int = 0, desc: str = "rl", mlflow_tracking_uri: str | None = None,
                 mlflow_experiment: str = "looprl"):
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
        self.mlflow = MlflowRun(self.dir, mlflow_tracking_uri, mlflow_experiment, config, desc) \
            if mlflow_tracking_uri else None
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
        if self.mlflow is not None:
            self.mlflow.log(numeric, step)
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
        if self.mlflow is not None:
            self.mlflow.close()


class MlflowRun:
    """One MLflow run per output directory and stage (`desc`): its id is kept in `mlflow_<desc>_run_id`, so a
    resumed run logs into the same MLflow run; the recipe's resolved keys are its parameters."""

    def __init__(self, out: Path, uri: str, experiment: str, config: dict | None, desc: str):
        import os
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise RuntimeError("logging.mlflow_tracking_uri is set but mlflow is not installed "
                               "(pip install 'looprl[mlflow]')") from exc
        if uri.startswith("file:") or "://" not in uri:  # MLflow 3 refuses its file store unless asked for
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(uri)
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        id_file = out / f"mlflow_{desc}_run_id"
        if id_file.exists():
            self.run_id = id_file.read_text().strip()
        else:
            self.run_id = self.client.create_run(exp_id, run_name=f"{out.name}/{desc}").info.run_id
            id_file.write_text(self.run_id)
            for key, value in flat_params(config or {}).items():
                self.client.log_param(self.run_id, key, value)
        self.client.update_run(self.run_id, status="RUNNING")

    def log(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_name(k), float(v), now, step)
                                                    for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def mlflow_name(key: str) -> str:
    """A metric key as MLflow accepts it (names are file paths in its file store: no `//`, `..` or leading `/`,
    letters, digits and `_-. :/` only), e.g. a reward labelled by its plugin's path."""
    import re
    name = re.sub(r"[^\w\-. :/]", "_", key)
    name = re.sub(r"/{2,}", "/", name).replace("..", "_").lstrip("/")
    return name or "_"


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """Dotted keys and their values as MLflow parameters (values cut to MLflow's 6,000 characters)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{name}."))
        else:
            out[name] = str(value)[:6000]
    return out


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
