"""The stage runner: a recipe's stages in order, each reused when its record matches its fingerprint, run in
the driver (stages that drive actor groups) or as a Ray task with the resources the stage declares. The
contract a stage is written against (`Stage`, `StageContext`, fingerprints) is `rl.stages`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import ray
from omegaconf import DictConfig

from rl.config import as_container
from rl.registry import lookup
from rl.stages import (
    Stage,
    StageContext,
    StageError,
    config_fingerprint_part,
    files_identity,
    fingerprint,
    say,
)


def _record_path(cfg: DictConfig, name: str) -> Path:
    return Path(cfg.output_dir) / "stages" / f"{name}.json"


def read_record(cfg: DictConfig, name: str) -> dict | None:
    path = _record_path(cfg, name)
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return record if record.get("complete") else None


def _run_remote(spec: str, params: dict[str, Any], key: str, ctx: StageContext
                ) -> tuple[dict[str, str], dict[str, Any]]:
    # resolved again in the task's process: a plugin class from a file is not importable by reference
    artifacts = make_stage(spec, params, key).run(ctx)
    return artifacts, ctx.summary


def make_stage(spec: str, params: dict[str, Any], key: str) -> Any:
    """The stage object for `spec` with `params`; a wrong parameter fails naming the recipe key."""
    cls = lookup("stage", spec)
    try:
        return cls(**params)
    except TypeError as exc:
        raise StageError(f"{key}.params: stage {spec!r} does not take {sorted(params)}: {exc}") from exc


def check_only_stage(labels: list[str], only: str | None) -> None:
    """`--stage NAME` names one of the recipe's stages."""
    if only is not None and only not in labels:
        raise StageError(f"--stage {only!r}: the recipe's stages are {labels}")


def run_stages(cfg: DictConfig, runtime: Any, only: str | None = None) -> dict[str, Any]:
    """Run the recipe's stages in order (skipping those whose record matches), or only the stage `only`.
    Returns the merged summary, with `stages`: each stage's artifacts, wall time and whether it was reused."""
    entries = list(cfg.stages)
    names = [e.label or e.name for e in entries]
    check_only_stage(names, only)
    summary: dict[str, Any] = {"stages": {}}
    artifacts: dict[str, dict[str, str]] = {}
    upstream: list[str] = []
    for i, (entry, name) in enumerate(zip(entries, names)):
        key = f"stages[{i}]"
        params = as_container(entry.params)
        stage = make_stage(entry.name, params, key)
        inputs = stage.input_files(cfg) if hasattr(stage, "input_files") else []
        fp = fingerprint(entry.name, params, config_fingerprint_part(cfg, getattr(stage, "config_keys", None)),
                         files_identity(*inputs), upstream)
        upstream.append(fp)
        record = read_record(cfg, name)
        if only is not None and name != only:
            if record is None:
                raise StageError(f"--stage {only!r} needs the artifacts of stage {name!r}, which has not completed "
                                 f"in {cfg.output_dir} (run the recipe without --stage first)")
            artifacts[name] = record["artifacts"]
            continue
        if (only is None and record is not None and record["fingerprint"] == fp
                and all(Path(p).exists() for p in record["artifacts"].values())):
            say(f"stage {name}: reusing its artifacts (same recipe and inputs)")
            artifacts[name] = record["artifacts"]
            summary.update(record.get("summary", {}))
            summary["stages"][name] = {"artifacts": record["artifacts"], "wall_s": record["wall_s"], "reused": True}
            continue
        _record_path(cfg, name).unlink(missing_ok=True)
        ctx = StageContext(cfg, name, dict(artifacts), fingerprint=fp)
        t0 = time.perf_counter()
        if getattr(stage, "runs_in_driver", False):
            ctx.runtime = runtime
            produced = stage.run(ctx)
        else:
            resources = dict(getattr(stage, "resources", Stage.resources))
            task = ray.remote(_run_remote).options(num_cpus=resources.pop("num_cpus", 0),
                                                   num_gpus=resources.pop("num_gpus", 0),
                                                   resources=resources or None, max_retries=0)
            say(f"stage {name}: running as a Ray task ({entry.name})")
            produced, ctx.summary = ray.get(task.remote(entry.name, params, key, ctx))
        produced = {k: str(v) for k, v in (produced or {}).items()}
        wall = time.perf_counter() - t0
        artifacts[name] = produced
        summary.update(ctx.summary)
        summary["stages"][name] = {"artifacts": produced, "wall_s": wall, "reused": False}
        path = _record_path(cfg, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"stage": entry.name, "fingerprint": fp, "artifacts": produced, "wall_s": wall,
                                    "summary": ctx.summary, "complete": True}, indent=2, default=str))
    return summary
