"""Ray bring-up and placement groups for the learner/rollout roles."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import random
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from rl.progress import say  # standard library only: every worker imports this module at start-up

# Environment every looprl actor gets: one intra-op thread per rank avoids 10-100x slow-downs from
# oversubscribed cores on CPU; quiet transformers/datasets progress bars; auth mode passed through.
# The two glibc malloc settings keep freed activation/gradient blocks in the heap instead of handing
# them back to the kernel after every step and page-faulting them in again on the next one (CPU
# training steps of the 85M benchmark model otherwise swing between 1.3 s and 2 s); values already
# in the driver's environment win.
ACTOR_ENV = {
    "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", str(32 << 20)),
    "MALLOC_TRIM_THRESHOLD_": os.environ.get("MALLOC_TRIM_THRESHOLD_", str(64 << 30)),
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_OFFLINE": "1",
    "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", ""),
}


# Where a rendezvous port is drawn: above Ray's worker ports (10002-19999 by default) and below the kernel's
# ephemeral range. A port the kernel hands out for `bind(0)` lies in that range, where every outgoing connection
# (Ray's gRPC channels, gloo's pairs, the object store's transfers) also takes its local port: one of them can take
# it between the check and the rank that binds it (DeepSpeed's TCPStore failing with EADDRINUSE).
RENDEZVOUS_PORTS = (20000, 32768)
_ports_handed_out: set[int] = set()  # a port is not handed out twice by one process, even once closed again


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's `ip_local_port_range`, 32768 when unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # every address, as the rendezvous binds it
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free on this host now, for a rendezvous a process binds later: drawn at random from
    `RENDEZVOUS_PORTS` below the ephemeral range (no outgoing connection takes it meanwhile), never the same
    twice from one process. Falls back to a kernel-chosen port where that range is empty."""
    low, high = RENDEZVOUS_PORTS[0], min(RENDEZVOUS_PORTS[1], ephemeral_low())
    draw = random.SystemRandom()  # not the seeded module state: two seeded processes would draw the same ports
    for _ in range(256 if high > low else 0):
        port = draw.randrange(low, high)
        if port not in _ports_handed_out and _bindable(port):
            _ports_handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def unfinished(refs: list, timeout_s: float) -> list[int]:
    """Indices of `refs` still running after waiting up to `timeout_s` for all of them (none when
    `timeout_s <= 0`: no deadline). How every deadline on a remote actor finds the stuck ones."""
    if timeout_s <= 0 or not refs:
        return []
    _, waiting = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    return [i for i, ref in enumerate(refs) if ref in waiting]


def exec_with_actor_malloc() -> None:
    """Restarts this process (same interpreter, flags and arguments) with the actors' glibc malloc settings
    (`ACTOR_ENV`) where its environment lacks them; returns at once where it has them. glibc reads them once, at
    start-up: a benchmark that times a learner or a decode in its own process pays what an actor pays only when
    started with them (without them its steps page-fault their freed activations in again)."""
    missing = {k: v for k, v in ACTOR_ENV.items() if k.startswith("MALLOC_") and os.environ.get(k) != v}
    if missing:
        sys.stdout.flush()
        os.execve(sys.executable, sys.orig_argv, {**os.environ, **missing})


def actor_env() -> dict[str, str]:
    env = {k: v for k, v in ACTOR_ENV.items() if v}
    env["RAY_AUTH_MODE"] = os.environ.get("RAY_AUTH_MODE", "disabled")
    if "LOOPRL_SANDBOX" in os.environ:  # the recipe's rollout.sandbox (rl.tools), for the tools the actors run
        env["LOOPRL_SANDBOX"] = os.environ["LOOPRL_SANDBOX"]
    return env


# transformers' optional imports that no looprl process uses: scikit-learn (assisted generation's candidate
# generator, for one ROC curve, and pandas with it) and scipy (the object-detection losses' matching). Every
# process that loads a transformers model imports them otherwise: 1.2-1.7 s of each actor's 5-7 s start-up on a
# CPU core (`python -X importtime -c "import cluster.learner"`).
SKIPPED_OPTIONAL_IMPORTS = ("is_sklearn_available", "is_scipy_available")
# Modules a package tries to import (and does without) that looprl's processes do not use through it: DeepSpeed's
# autotuner imports MLflow for its own experiment logging (with pandas, pyarrow and fastapi), 2.2 s of each
# learner's start-up on an AMD EPYC core (`python -X importtime -c "import deepspeed"`). Hidden only while the
# package loads: a run that logs to MLflow (`logging.mlflow_tracking_uri`) imports it afterwards as usual.
HIDDEN_WHILE_IMPORTING = {"deepspeed": ("mlflow",)}


def _report_unavailable(utils: Any) -> None:
    for name in SKIPPED_OPTIONAL_IMPORTS:
        if hasattr(utils, name):
            setattr(utils, name, lambda: False)


def _load_hiding(load: Any, module: Any, hidden: tuple[str, ...]) -> None:
    """Run `load(module)` with `hidden` (those not yet imported) made unimportable: a `None` in `sys.modules`
    makes `import` raise ImportError, which the package handles as "not installed"; removed afterwards."""
    placed = [name for name in hidden if name not in sys.modules]
    sys.modules.update(dict.fromkeys(placed))
    try:
        load(module)
    finally:
        for name in placed:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


class _OnImport(importlib.abc.MetaPathFinder):
    """Finds the module `name` with the other finders and has its loader run it through `wrap(load, module)` (which
    calls the real `load`); leaves `sys.meta_path` when the module loads. A mere probe for the module
    (`importlib.util.find_spec`, as transformers' `is_deepspeed_available` does) gets a spec that is never loaded,
    so the finder stays until the import itself."""

    def __init__(self, name: str, wrap: Any):
        self.name, self.wrap, self.searching = name, wrap, False

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.name or self.searching:
            return None
        self.searching = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.searching = False
        if spec is not None and spec.loader is not None:
            load = spec.loader.exec_module

            def exec_module(module: Any) -> None:
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                self.wrap(load, module)
            spec.loader.exec_module = exec_module
        return spec


def _after_transformers_utils(load: Any, module: Any) -> None:
    load(module)
    _report_unavailable(module)  # before any model module reads it


def skip_optional_imports() -> None:
    """Ray's `worker_process_setup_hook` for looprl's jobs (`job_runtime_env`): in each worker process, transformers
    reports `SKIPPED_OPTIONAL_IMPORTS` as unavailable, so loading a model does not import them, and the packages of
    `HIDDEN_WHILE_IMPORTING` load without the modules listed. A process that never imports transformers or
    DeepSpeed (a reward worker) pays nothing: each change waits for its package to load. Code that imports
    scikit-learn, scipy or MLflow itself (a reward plugin, a stage, the run's tracking) gets them as usual."""
    waiting = {f.name for f in sys.meta_path if isinstance(f, _OnImport)}
    if "transformers.utils" in sys.modules:
        _report_unavailable(sys.modules["transformers.utils"])
    elif "transformers.utils" not in waiting:
        sys.meta_path.insert(0, _OnImport("transformers.utils", _after_transformers_utils))
    for package, hidden in HIDDEN_WHILE_IMPORTING.items():
        if package not in sys.modules and package not in waiting:
            sys.meta_path.insert(0, _OnImport(package, functools.partial(_load_hiding, hidden=hidden)))


def job_runtime_env() -> dict[str, Any]:
    """The runtime environment of looprl's Ray jobs: `actor_env()` and the worker set-up hook above (actors' own
    `runtime_env` adds environment variables to it)."""
    return {"env_vars": actor_env(), "worker_process_setup_hook": f"{__name__}.skip_optional_imports"}


@dataclass
class Placement:
    """Where each role goes: bundle index per learner rank and per rollout worker."""
    group: PlacementGroup
    learner_bundles: list[int]
    rollout_bundles: list[int]
    gpus_per_actor: float = 0.0  # colocated roles share a bundle's GPU
    rollout_gpus_per_actor: float = 0.0  # a rollout worker's GPUs: its share when colocated, its bundle's when split


    def remove(self) -> None:
        remove_placement_group(self.group)


def bundle_options(placement: Placement | None, index: int, num_gpus: float = 0.0, num_cpus: float = 0.0
                   ) -> dict[str, Any]:
    """Ray options that run an actor or task in the run's learner bundle `index` (modulo their count), taking
    `num_gpus` of its device: how a stage's helper actors use the reserved resources while no learner holds
    them (outside the placement group a GPU request could never be met on a node it fills)."""
    opts: dict[str, Any] = {"num_cpus": num_cpus}
    if num_gpus:
        opts["num_gpus"] = num_gpus
    if placement is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        bundles = placement.learner_bundles
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement.group, placement_group_bundle_index=bundles[index % len(bundles)])
    return opts


def wait_for_bundles(bundles: list[dict[str, float]], strategy: str, timeout_s: float, can_grow: bool = True,
                     every_s: float = 30.0) -> PlacementGroup:
    """Reserve `bundles` as one placement group. A need larger than the whole cluster is refused at once when the
    cluster cannot grow (a private local instance); a need other jobs hold is waited for, saying so every
    `every_s`, for at most `timeout_s`, and then refused naming what was needed, free and held."""
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            need[key] = need.get(key, 0.0) + amount
    total = ray.cluster_resources()
    short = {k: v for k, v in need.items() if v > total.get(k, 0.0) + 1e-9}
    if short and not can_grow:
        raise RuntimeError(f"this run needs {_amounts(need)} and its Ray instance has {_amounts(total, need)} in all: "
                           "lower learner.num_cpus / rollout.num_cpus / the actor counts, or raise cluster.num_cpus")
    pg = placement_group(bundles, strategy=strategy)
    start = time.monotonic()
    while True:
        ready, _ = ray.wait([pg.ready()], timeout=min(every_s, max(timeout_s - (time.monotonic() - start), 0.0)))
        if ready:
            return pg
        waited = time.monotonic() - start
        free = ray.available_resources()
        if waited >= timeout_s:
            remove_placement_group(pg)
            raise RuntimeError(f"this run's actors ({_amounts(need)}, {strategy}) could not be placed within "
                               f"{timeout_s:.0f}s (cluster.wait_for_resources_s): free {_amounts(free, need)} of "
                               f"{_amounts(ray.cluster_resources(), need)}; other jobs hold the rest")
        say(f"waiting {waited:.0f}s of {timeout_s:.0f}s for resources held by other jobs: this run needs "
            f"{_amounts(need)}, free {_amounts(free, need)} of {_amounts(ray.cluster_resources(), need)}")


def _amounts(resources: dict[str, float], keys: dict[str, float] | None = None) -> str:
    return "{" + ", ".join(f"{k}: {resources.get(k, 0.0):g}" for k in sorted(keys or resources)) + "}"


def make_placement(world_size: int, num_rollout: int, learner_cpus: float, rollout_cpus: float,
                   mode: str = "colocated", strategy: str = "PACK", use_gpu: bool = False,
                   timeout_s: float = 120.0, learner_resources: dict[str, float] | None = None,
                   rollout_resources: dict[str, float] | None = None, learner_roles: int = 1,
                   can_grow: bool = True, rollout_gpus: int = 1) -> Placement:
    """One placement group for learners and rollout workers.

    colocated: bundle i holds learner rank i and rollout worker i (they take turns on the same
    resources, as in verl's hybrid engine); split: learners and rollout workers get their own bundles.
    `learner_resources` / `rollout_resources` are extra Ray resources each role's bundles ask for
    (custom node resources such as `{"trainer_node": 1}` pin roles to the nodes that offer them).
    `learner_roles`: actors per learner bundle (2 with PPO's critic beside each policy rank); a GPU bundle's
    device is shared evenly by the actors of its most crowded bundle. `timeout_s` and `can_grow`: see
    `wait_for_bundles`. `rollout_gpus` (split placement): GPUs of each rollout bundle, one tensor-parallel engine's.
    """
    gpu = {"GPU": 1} if use_gpu else {}
    extra_l, extra_r = dict(learner_resources or {}), dict(rollout_resources or {})
    if mode == "colocated":
        n = max(world_size, num_rollout)
        bundles = [{"CPU": learner_cpus + rollout_cpus, **gpu, **extra_l, **extra_r} for _ in range(n)]
        learner, rollout = list(range(world_size)), list(range(num_rollout))
    elif mode == "split":
        bundles = [{"CPU": learner_cpus, **gpu, **extra_l} for _ in range(world_size)] + \
                  [{"CPU": rollout_cpus, **({"GPU": rollout_gpus} if use_gpu else {}), **extra_r}
                   for _ in range(num_rollout)]
        learner = list(range(world_size))
        rollout = list(range(world_size, world_size + num_rollout))
    else:
        raise ValueError(f"cluster.placement must be colocated or split, got {mode!r}")
    pg = wait_for_bundles(bundles, strategy, timeout_s, can_grow)
    share = 1.0 / (learner_roles + 1) if mode == "colocated" else 1.0 / learner_roles
    return Placement(pg, learner, rollout, gpus_per_actor=share if use_gpu else 0.0,
                     rollout_gpus_per_actor=(share if mode == "colocated" else float(rollout_gpus)) if use_gpu else 0.0)
