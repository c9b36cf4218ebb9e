import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the `xdist_group` marks
def pytest_collection_modifyitems(config, items):
    """`extended` end-to-end runs (a feature's second CI-sized run) are left out unless LOOPRL_EXTENDED=1
    (`make test-all`), so that `make test` stays well inside the CI budget. A test that starts Ray (the
    `ray_cluster` fixture) is marked `ray`, so that mutation testing can run the fast tests alone. The tests of a
    module with a module-scoped fixture share an `xdist_group`: under `pytest -n 2 --dist loadgroup` one worker
    runs them all and builds the fixture once."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
        if _module_fixtures(item):  # `make test` runs two workers (--dist loadgroup): a module's fixture is built once
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    if os.environ.get("LOOPRL_EXTENDED") == "1":
        return
    kept = [item for item in items if item.get_closest_marker("extended") is None]
    left_out = [item for item in items if item.get_closest_marker("extended") is not None]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


def _module_fixtures(item) -> bool:
    """Whether the test uses a fixture built once per module or package (a trained model, an engine)."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(d.scope in ("module", "package") for defs in info.name2fixturedefs.values()
                                    for d in defs)


@pytest.fixture(scope="session")
def ray_cluster():
    """One private local Ray for the whole session (starting one costs seconds)."""
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
