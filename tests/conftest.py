import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite's processes share the cores (two pytest workers, Ray's actors, the runs' subprocesses): a thread team that
# spins while it waits for a descheduled member burns the core another process needs. With one busy process beside
# it, 60 steps of the judge's teaching (tests/rewards/test_judged.py, 2 threads) took 34 s and 53 CPU-seconds with
# OpenMP's default waits and 14 s and 25 CPU-seconds with passive ones (the same on an idle machine: 9-10 s). The
# numbers are unchanged: the thread count and the split of the work are the same. Actors and subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


# Under pytest-xdist (`make test` runs `-n 2`) a worker writes each collected test's group here and the scheduler
# below reads it (pytest 9 ignores the nodeid suffix through which xdist's own `loadgroup` would carry it).
GROUPS_DIR = "LOOPRL_TEST_GROUPS_DIR"


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        import tempfile
        os.environ[GROUPS_DIR] = tempfile.mkdtemp(prefix="looprl-test-groups-")  # the workers inherit it


def pytest_unconfigure(config):
    if os.environ.get(GROUPS_DIR) and "PYTEST_XDIST_WORKER" not in os.environ:
        import shutil
        shutil.rmtree(os.environ.pop(GROUPS_DIR), ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """`extended` end-to-end runs (a feature's second CI-sized run) are left out unless LOOPRL_EXTENDED=1
    (`make test-all`), so that `make test` stays well inside the CI budget. A test that starts Ray (the
    `ray_cluster` fixture) is marked `ray`, so that mutation testing can run the fast tests alone."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
    if os.environ.get("LOOPRL_EXTENDED") != "1":
        kept = [item for item in items if item.get_closest_marker("extended") is None]
        left_out = [item for item in items if item.get_closest_marker("extended") is not None]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = kept
    if os.environ.get(GROUPS_DIR) and "PYTEST_XDIST_WORKER" in os.environ:
        import json
        groups = {item.nodeid: _group(item) for item in items}
        items[:] = _in_dispatch_order(items, groups)  # every worker collects the same order; the scheduler keeps it
        with open(os.path.join(os.environ[GROUPS_DIR], os.environ["PYTEST_XDIST_WORKER"] + ".json"), "w") as f:
            json.dump(groups, f)


# The `ray` tests of these folders form the Ray group; the others (a method's or a stage's end-to-end runs) are
# dispatched last, a module at a time, to whichever worker is free first.
RAY_GROUP_FOLDERS = ("tests/cluster/", "tests/rollout/")
RAY_GROUP, RAY_TAIL = "ray", "ray-tail:"


def _group(item) -> str:
    """The `ray` tests of `RAY_GROUP_FOLDERS` form one group: they share a Ray instance on one worker, one after
    another, each end-to-end run with the cores Ray was told it has. Every other test module is a group of its own,
    so that its module fixtures (a taught judge, a tiny engine) are built once: those without Ray run on the other
    worker beside the Ray group and fill the cores a single-threaded test leaves idle; those with Ray
    (`RAY_TAIL` + module) come last, so that the worker that finishes first takes them (with a Ray instance of its
    own when it is not the Ray group's) and both workers end close together. One Ray group alone took 1013 s of a
    1032-s suite whose other worker ended at 797 s (AMD EPYC, 2 cores)."""
    module = _module(item.nodeid)
    if not item.get_closest_marker("ray"):
        return module
    return RAY_GROUP if module.startswith(RAY_GROUP_FOLDERS) else RAY_TAIL + module


def _in_dispatch_order(items: list, groups: dict[str, str]) -> list:
    """The Ray group first; then the modules without Ray, those with `slow` tests (end-to-end runs in
    subprocesses) first and then by size; the Ray tail last, the largest module first. A group's tests keep their
    order."""
    from collections import Counter
    size = Counter(groups[item.nodeid] for item in items)
    with_slow = {groups[item.nodeid] for item in items if item.get_closest_marker("slow")}

    def rank(group: str) -> tuple:
        tier = 0 if group == RAY_GROUP else 2 if group.startswith(RAY_TAIL) else 1
        return (tier, tier == 1 and group not in with_slow, -size[group])
    order = {group: i for i, group in enumerate(sorted(size, key=rank))}
    return sorted(items, key=lambda item: order[groups[item.nodeid]])


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Each group (`_group`) goes whole to one worker, in the order of `_in_dispatch_order` (xdist's scope
    scheduling); `--dist` other than `load` keeps xdist's own scheduler."""
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None
    import glob
    import json

    from xdist.scheduler import LoadScopeScheduling
    config.option.loadscopereorder = False  # groups go out in the collection's order (`_in_dispatch_order`)

    class GroupScheduling(LoadScopeScheduling):
        groups: dict[str, str]

        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.groups = {}

        def _split_scope(self, nodeid: str) -> str:
            if not self.groups:  # every worker has finished collecting when the scheduler asks
                for path in glob.glob(os.path.join(os.environ[GROUPS_DIR], "*.json")):
                    with open(path) as f:
                        self.groups.update(json.load(f))
            return self.groups.get(nodeid) or _module(nodeid)

    return GroupScheduling(config, log)


@pytest.fixture(scope="session")
def ray_cluster():
    """One private local Ray per test process, for its whole session (starting one costs seconds)."""
    import ray

    from cluster.ray_utils import job_runtime_env
    started = not ray.is_initialized()
    if started:  # a private local instance ("local"): never attach to a cluster that happens to be running
        ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env=job_runtime_env())
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A tiny hf engine built in code (hidden 64, 2 layers), one per test module; a module that needs another
    shape defines its own `engine`."""
    from models.tiny import save_tiny
    from rollout.hf_engine import HFEngine
    return HFEngine(str(save_tiny(tmp_path_factory.mktemp("m"), hidden_size=64, num_layers=2, num_heads=2,
                                  intermediate_size=128)))
