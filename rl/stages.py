"""Stages: the steps of a recipe (registry kind `stage`), run in the order of the recipe's `stages:` list.

A stage is a class: `Cls(**params)` then `run(ctx) -> artifacts`, where artifacts map names to paths
(datasets, model folders, reports) that later stages read with `ctx.artifact(name)` (the latest stage that
published a name wins: a data-selection stage's `train` replaces the data stage's for RL).

* Built-in stages that drive actor groups (`runs_in_driver = True`) run in the driver and get its runtime
  (`ctx.runtime`, a `StageRuntime`): the capabilities a stage uses instead of importing the driver: fine-tune
  a model, start and use rollout workers, score with the reward service, start judges, run a function as a
  Ray task in the run's reserved resources. Other stages run as a Ray
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
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig, OmegaConf

from models.tokenizer import load_tokenizer
from rl.config import as_container
from rl.data import load_rows
from rl.progress import say  # noqa: F401  (the stages' progress lines; imported from here by the stages)
from rl.sft_data import sft_rows_and_examples


class StageError(RuntimeError):
    """A stage could not run: names the stage and what is missing."""


@dataclass
class StageContext:
    cfg: DictConfig  # the resolved recipe
    name: str  # this stage's name in the recipe
    artifacts: dict[str, dict[str, str]]  # artifacts of the stages before this one, by stage name, in order
    summary: dict[str, Any] = field(default_factory=dict)  # what this stage adds to summary.json
    runtime: StageRuntime | None = None  # the driver's capabilities (driver stages only)
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

    def rows(self, split: str, columns: list[str]) -> list[dict]:
        """The rows of the data split `split` (`train`, `eval`, ...) an earlier stage published, or none."""
        path = self.artifact(split)
        return load_rows(path, columns, f"data.{split}_path", bad_rows=self.cfg.data.bad_rows) if path else []

    def require(self, key: str) -> str:
        value = self.artifact(key)
        if value is None:
            raise StageError(f"stage {self.name!r} needs an artifact {key!r}, which no earlier stage "
                             f"({list(self.artifacts)}) published")
        return value


class StageRuntime(Protocol):
    """What the driver lends the stages that run in it (`ctx.runtime`): every capability a stage needs from the
    actor system, so that a stage imports nothing above the library. The driver's implementation is
    `cluster.runtime.Runtime`; the methods here state the contract."""

    placement: Any  # where the learner and rollout actors run (their reserved resources)
    judges: dict[str, Any]  # the reward judges serving the run (name -> client)
    rl_roles: Any  # the live RL run's actors (`rl.loop.roles.RLRoles`), or None

    def run_task(self, fn: Callable[..., Any], *args: Any, bundle: int = 0, num_gpus: float = 0.0, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` as a Ray task in the run's learner bundle `bundle` (taking `num_gpus` of its device);
        returns its result."""

    def start_actor(self, cls: type, *args: Any, bundle: int = 0, num_gpus: float = 0.0) -> Any:
        """An actor `cls(*args)` of the stage's own in the learner bundle `bundle`; call its methods with `call`,
        wait with `wait`, stop it with `stop_actors`."""

    def call(self, actor: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        """Start `actor.method(*args, **kwargs)` on an actor the runtime started for the stage (`start_actor`,
        `start_rollout_workers`); returns at once with a reference to resolve with `wait`."""

    def wait(self, refs: Any, timeout: float | None = None) -> Any:
        """The result(s) of remote calls (one reference or a list), waiting at most `timeout` seconds."""

    def rendezvous(self, world_size: int) -> tuple[str, int]:
        """An address and a free port for a process group of `world_size` ranks started by a stage."""

    def fine_tune(self, cfg: Any, model_path: str, out_path: str, tokenizer: Any, examples: list, *,
                  eval_examples: list | None = None, fingerprint: str = "", shuffle: bool = True) -> dict[str, float]:
        """SFT of `model_path` on tokenized `examples` under the recipe `cfg`'s `sft` section, saved as an HF
        model at `out_path`; returns the summary (steps, wall time, final losses)."""

    def learner_group(self, cfg: Any, model_path: str, **params: Any) -> Any:
        """A learner group on `model_path` (`cluster.roles.make_learner_group`'s parameters)."""

    def start_rollout_workers(self, cfg: Any, model_path: str) -> list[Any]:
        """Rollout workers serving `model_path`; the caller stops them (`stop_actors`)."""

    def rollout_workers(self, ctx: StageContext, cfg: Any) -> AbstractContextManager[list[Any]]:
        """The RL run's rollout workers when this run trains; otherwise workers on the stage's policy, stopped
        when the block ends."""

    def stop_actors(self, actors: list[Any]) -> None:
        """Stop actors the runtime started for the stage."""

    def start_rl_roles(self, cfg: Any, algorithm: Any, model_path: str, tokenizer: Any) -> Any:
        """The actors of an RL run of `algorithm` (`rl.algorithm.RLAlgorithm`) on the policy at `model_path`, behind
        the loop's contract (`rl.loop.roles.RLRoles`); they stay live for the stages after it (`rl_roles`) until
        `release_trainer` or the end of the run."""

    def release_trainer(self) -> None:
        """Stop the live RL run's actors (its learners hold the learner bundles a later fine-tune needs); the
        stages after this one start their own. No-op when no trainer is live."""

    def generate(self, workers: list[Any], tokenizer: Any, cfg: Any, rows: list[dict], **sampling: Any) -> Any:
        """A `Batch` of responses to `rows` from `workers` (`cluster.rollout_pipeline.generate`'s parameters)."""

    def score(self, batch: Any, evaluation: bool = False) -> list[dict]:
        """The reward service's scores of `batch` (with `evaluation`, eval-only functions too)."""

    def score_items(self, items: list[dict], evaluation: bool = False) -> list[dict]:
        """The reward service's scores of reward items (`prompt`, `response`, `ground_truth`, `metadata`, ...)."""

    def start_judges(self, judges: dict[str, Any], policy_path: str) -> dict[str, Any]:
        """Judge groups (`reward.judges` entries) serving frozen models (a null `model_path`: `policy_path`)."""

    def stop_judges(self, clients: Any) -> None:
        """Stop judge clients (a dict of them by name, or any iterable of them)."""

    def serve_reward_judges(self, cfg: Any, policy_path: str, summary: dict, artifact: Callable[[str], str]
                            ) -> dict[str, Any]:
        """Start the recipe's `reward.judges` and hand them to the reward service (the run's `judges`)."""


def stage_cfg(ctx: StageContext) -> DictConfig:
    """The recipe as a stage reads it: a `data.prompt_prefix` of the form `artifact:NAME` becomes the text of that
    earlier stage's artifact (e.g. MEMO's `memo_prompt`) and a blank line; a `learner.optimizer.params` value of
    that form becomes the artifact's path (e.g. `bundle: artifact:pert_bundle`, the ZO Fine-tuner's learned
    perturbation shape). A copy: the recipe itself (and so every stage's fingerprint) keeps the reference."""
    cfg = ctx.cfg
    prefix = cfg.data.prompt_prefix
    if str(prefix).startswith("artifact:"):
        text = Path(ctx.require(prefix.split(":", 1)[1])).read_text().strip()
        cfg = OmegaConf.merge(cfg, {"data": {"prompt_prefix": f"{text}\n\n"}})
    params = cfg.learner.optimizer.get("params") or {}
    # resolved where an earlier stage published it (a stage before that one does not train with this optimizer;
    # one that does gets the optimizer's own error naming the reference)
    found = {k: ctx.artifact(v.split(":", 1)[1]) for k, v in params.items()
             if isinstance(v, str) and v.startswith("artifact:")}
    paths = {k: v for k, v in found.items() if v is not None}
    if paths:
        cfg = OmegaConf.merge(cfg, {"learner": {"optimizer": {"params": paths}}})
    return cfg


def policy_sft_data(ctx: StageContext, purpose: str) -> tuple[Any, str, Any, list[dict], list, dict[str, int]]:
    """What a stage that reads the SFT data with the current policy needs: the stage's config, the `policy` folder,
    its tokenizer, the SFT rows, their tokenized examples and the dropped-row counts. `purpose` names what the data
    is for in the error raised when there is none."""
    cfg = stage_cfg(ctx)
    path = ctx.artifact("sft")
    if path is None:
        raise StageError(f"{ctx.name}: no {purpose} (set data.sft_path, or a synthetic task with an SFT split)")
    base = ctx.require("policy")
    tokenizer = load_tokenizer(base)
    rows, examples, dropped = sft_rows_and_examples(tokenizer, path, "data.sft_path", cfg.sft, cfg.data)
    return cfg, base, tokenizer, rows, examples, dropped


class Stage:
    """Base class of stages (subclassing it is optional: `run(ctx)` is the contract)."""

    config_keys: tuple[str, ...] | None = None  # dotted recipe keys the result depends on; None: the whole recipe
    # Ray resources of the task a non-driver stage runs in: declare what it needs (it may run beside the
    # learner and rollout actors, whose placement holds their share of the cluster)
    resources: dict[str, float] = {"num_cpus": 0}
    runs_in_driver: bool = False  # drives actor groups through the driver's runtime
    # The artifacts the stage needs from earlier stages (`ctx.require`) and those it may publish: the recipe's
    # order is checked against them before any actor starts. None: not declared (a plug-in's stage), not checked.
    reads: tuple[str, ...] | None = None
    publishes: tuple[str, ...] | None = None

    def run(self, ctx: StageContext) -> dict[str, str]:
        raise NotImplementedError


def check_stage_order(stages: list[tuple[str, Any]]) -> None:
    """Refuse an order in which a stage reads an artifact no earlier stage publishes, naming both stages where a
    later one publishes it. `stages`: (label, stage object) in recipe order."""
    published: dict[str, str] = {}
    for i, (label, stage) in enumerate(stages):
        for artifact in getattr(stage, "reads", None) or ():
            if artifact in published:
                continue
            later = [other for other, st in stages[i + 1:] if artifact in (getattr(st, "publishes", None) or ())]
            where = f"; stage {later[0]!r} publishes it, after it: move {later[0]!r} before {label!r}" if later else \
                "; no stage of the recipe publishes it"
            raise StageError(f"stages[{i}] ({label!r}) reads the artifact {artifact!r} before it is published{where}")
        for artifact in getattr(stage, "publishes", None) or ():
            published.setdefault(artifact, label)


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


