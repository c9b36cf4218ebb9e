import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    """`extended` end-to-end runs (a feature's second CI-sized run) are left out unless LOOPRL_EXTENDED=1
    (`make test-all`), so that `make test` stays well inside the CI budget. A test that starts Ray (the
    `ray_cluster` fixture) is marked `ray`, so that mutation testing can run the fast tests alone."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
    if os.environ.get("LOOPRL_EXTENDED") == "1":
        return
    kept = [item for item in items if item.get_closest_marker("extended") is None]
    left_out = [item for item in items if item.get_closest_marker("extended") is not None]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


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
