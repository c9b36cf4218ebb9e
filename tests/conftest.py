import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def ray_cluster():
    """One private local Ray for the whole session (starting one costs seconds)."""
    import ray

    from cluster.ray_utils import actor_env
    started = not ray.is_initialized()
    if started:  # a private local instance: never attach to a cluster that happens to be running
        ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": actor_env()})
    yield ray
    if started:
        ray.shutdown()
