"""Stages: the steps of a recipe (registry kind `stage`), run in the order of the recipe's `stages:` list.

A stage is a class: `Cls(**params)` then `run(ctx) -> artifacts`, where artifacts map names to paths
(datasets, model folders, reports) that later stages read with `ctx.artifact(name)` (the latest stage that
published a name wins: a data-selection stage's `train` replaces the data stage's for RL).

* Built-in stages that drive actor groups (`runs_in_driver = True`) run in the driver and share its
  runtime (`ctx.runtime`: Ray placement, reward service, the live trainer). Other stages run as a Ray
  task with the resources they declare (`resources`, default none reserved) and get a context without
  the runtime; what they add to `ctx.summary` comes back with their artifacts.
* Every stage has a fingerprint: its name, params, the recipe keys it declares (`config_keys`; a user
  stage depends on the whole recipe), the identity (size, modification time) of the files outside the run
  it reads (`input_files(cfg)`, e.g. the recipe's data files) and the fingerprints of every stage before it. A stage whose record
  (`output_dir/stages/NAME.json`) is complete with the same fingerprint, and whose artifacts are all on
  disk, is skipped and its artifacts are reused; a changed stage re-runs, and so does every stage after it (their fingerprints change with it).
* `looprl run RECIPE --stage NAME` runs that stage alone, with the artifacts of the stages before it read
  from their records.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rl.config import as_container
from rl.registry import get


class StageError(RuntimeError):
    """A stage could not run: names the stage and what is missing."""


@dataclass
class StageContext:
    cfg: DictConfig  # the resolved recipe
    name: str  # this stage's name in the recipe
    artifacts: dict[str, dict[str, str]]  # artifacts of the stages before this one, by stage name, in order
    summary: dict[str, Any] = field(default_factory=dict)  # what this stage adds to summary.json
    runtime: Any = None  # the driver's shared services (driver stages only)
    fingerprint: str = ""  # this stage's fingerprint (a checkpoint it writes is resumed only under the same one)

    @property
    def output_dir(self) -> Path:
        return Path(self.cfg.output_dir)

    @property
    def stage_dir(self) -> Path:
        """A folder of this stage's own, `output_dir/stages/NAME/` (created on first use)."""
        d = self.output_dir / "stages" / self.name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def artifact(self, key: str, default: str | None = None) -> str | None:
        """The latest earlier stage's artifact `key`, or `default`."""
        for arts in reversed(list(self.artifacts.values())):
            if key in arts:
                return arts[key]
        return default

    def artifact_before(self, key: str, later: str) -> str:
        """The artifact `key` as it was before the earliest stage that published `later` (e.g. the policy
        the RL stage started from: `artifact_before("policy", "checkpoint")`)."""
        value = None
        for arts in self.artifacts.values():
            if later in arts:
                break
            value = arts.get(key, value)
        if value is None:
            raise StageError(f"stage {self.name!r} needs the artifact {key!r} from before {later!r}")
        return value

    def require(self, key: str) -> str:
        value = self.artifact(key)
        if value is None:
            raise StageError(f"stage {self.name!r} needs an artifact {key!r}, which no earlier stage "
                             f"({list(self.artifacts)}) published")
        return value


class Stage:
    """Base class of stages (subclassing it is optional: `run(ctx)` is the contract)."""

    config_keys: tuple[str, ...] | None = None  # dotted recipe keys the result depends on; None: the whole recipe
    # Ray resources of the task a non-driver stage runs in: declare what it needs (it may run beside the
    # learner and rollout actors, whose placement holds their share of the cluster)
    resources: dict[str, float] = {"num_cpus": 0}
    runs_in_driver: bool = False  # drives actor groups through the driver's runtime

    def run(self, ctx: StageContext) -> dict[str, str]:
        raise NotImplementedError


def files_identity(*paths: str | None) -> list:
    """Name, size and modification time of every file at or below `paths` (None and missing paths count as
    such): what a stage that reads user files puts in its fingerprint, so that a file edited in place is
    read again."""
    out: list = []
    for p in paths:
        if p is None or not Path(p).exists():
            out.append([p, None])
            continue
        root = Path(p)
        files = [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.is_file())
        out.append([p, [[str(f.relative_to(root)) if f != root else f.name, f.stat().st_size,
                         f.stat().st_mtime_ns] for f in files]])
    return out


# Recipe keys that never change a result (where and how a run is shown, how it is resumed).
_NEUTRAL_KEYS = ("output_dir", "resume", "logging", "stages")


def config_fingerprint_part(cfg: DictConfig, keys: tuple[str, ...] | None) -> Any:
    if keys is None:
        return {k: v for k, v in as_container(cfg).items() if k not in _NEUTRAL_KEYS}
    return {k: as_container(OmegaConf.select(cfg, k)) for k in keys}


def fingerprint(*parts: Any) -> str:
    """Stable hash of the config parts an artifact was built from."""
    blob = json.dumps([as_container(p) for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def say(msg: str) -> None:
    """A progress line of the run on stderr."""
    print(f"[looprl] {msg}", file=sys.stderr, flush=True)


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
    cls = get("stage", spec)
    try:
        return cls(**params)
    except TypeError as exc:
        raise StageError(f"{key}.params: stage {spec!r} does not take {sorted(params)}: {exc}") from exc


def run_stages(cfg: DictConfig, runtime: Any, only: str | None = None) -> dict[str, Any]:
    """Run the recipe's stages in order (skipping those whose record matches), or only the stage `only`.
    Returns the merged summary, with `stages`: each stage's artifacts, wall time and whether it was reused."""
    import ray
    entries = list(cfg.stages)
    names = [e.label or e.name for e in entries]
    if only is not None and only not in names:
        raise StageError(f"--stage {only!r}: the recipe's stages are {names}")
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
