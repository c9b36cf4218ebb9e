import os

import ray

from cluster.ray_utils import actor_env


@ray.remote(num_cpus=0)
class _EnvProbe:
    def exec_environ(self) -> dict[str, str]:
        # /proc/<pid>/environ is the environment the process was started with, which is what glibc
        # reads its MALLOC_* tunables from (setting os.environ later would have no effect).
        raw = open(f"/proc/{os.getpid()}/environ", "rb").read().split(b"\0")
        return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


def test_actors_start_with_thread_and_malloc_settings(ray_cluster):
    env = actor_env()
    probe = _EnvProbe.options(runtime_env={"env_vars": env}).remote()
    seen = ray.get(probe.exec_environ.remote())
    for key in ("OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "RAY_AUTH_MODE"):
        assert seen.get(key) == env[key], key
    assert int(env["MALLOC_MMAP_THRESHOLD_"]) <= 32 << 20  # glibc rejects larger thresholds on 64-bit
    ray.kill(probe)
