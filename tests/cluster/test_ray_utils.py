import os
import socket

import ray

from cluster.ray_utils import RENDEZVOUS_PORTS, actor_env, ephemeral_low, free_port


@ray.remote(num_cpus=0)
class _EnvProbe:
    def exec_environ(self) -> dict[str, str]:
        # /proc/<pid>/environ is the environment the process was started with, which is what glibc
        # reads its MALLOC_* tunables from (setting os.environ later would have no effect).
        raw = open(f"/proc/{os.getpid()}/environ", "rb").read().split(b"\0")
        return dict(x.decode().split("=", 1) for x in raw if b"=" in x)

    def modules_loaded_by_model_imports(self) -> dict[str, list[str]]:
        import importlib.util
        import sys
        before = [m for m in ("transformers", "transformers.utils") if m in sys.modules]
        importlib.util.find_spec("deepspeed")  # a probe first, as transformers' is_deepspeed_available makes
        import deepspeed  # noqa: F401  (what a learner imports to start)
        from transformers import AutoModelForCausalLM  # noqa: F401

        import cluster.learner  # noqa: F401  (what a learner and a rollout worker import)
        import rollout.hf_engine  # noqa: F401
        after = [m for m in ("sklearn", "scipy", "pandas", "mlflow") if m in sys.modules]
        import mlflow  # noqa: F401
        import scipy.optimize  # noqa: F401  (code that imports them itself still can)
        return {"before": before, "after": after, "explicit": [m for m in ("scipy", "mlflow") if m in sys.modules]}


def test_actors_start_with_thread_and_malloc_settings(ray_cluster):
    env = actor_env()
    probe = _EnvProbe.options(runtime_env={"env_vars": env}).remote()
    seen = ray.get(probe.exec_environ.remote())
    for key in ("OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "RAY_AUTH_MODE"):
        assert seen.get(key) == env[key], key
    assert int(env["MALLOC_MMAP_THRESHOLD_"]) <= 32 << 20  # glibc rejects larger thresholds on 64-bit
    # the job's worker set-up hook reaches an actor with its own runtime_env: loading transformers' model classes
    # imports none of its unused optional dependencies, and a worker that never loads them does not import
    # transformers for the hook
    loaded = ray.get(probe.modules_loaded_by_model_imports.remote())
    assert loaded == {"before": [], "after": [], "explicit": ["scipy", "mlflow"]}
    ray.kill(probe)


def test_bundle_options_place_a_helper_actor_in_a_learner_bundle(ray_cluster):
    """A stage's helper actor runs inside the run's placement group, in the learner bundle asked for (modulo the
    bundles), so it uses the reserved resources instead of waiting for resources the group holds."""
    from ray.util import placement_group_table

    from cluster.ray_utils import bundle_options, make_placement
    assert bundle_options(None, 3, num_gpus=0.5) == {"num_cpus": 0.0, "num_gpus": 0.5}
    placement = make_placement(2, 1, learner_cpus=0.25, rollout_cpus=0.25, mode="split")
    try:
        opts = bundle_options(placement, 3)  # 3 % 2 learner bundles -> bundle 1
        assert opts["scheduling_strategy"].placement_group_bundle_index == placement.learner_bundles[1]

        @ray.remote
        def where() -> str:
            return ray.get_runtime_context().get_placement_group_id()
        assert ray.get(where.options(**opts).remote()) == placement.group.id.hex()
        assert placement_group_table(placement.group)["state"] == "CREATED"
    finally:
        placement.remove()


def test_a_need_larger_than_a_private_instance_is_refused_and_one_others_hold_is_waited_for(ray_cluster, capsys):
    import threading

    import pytest
    from ray.util.placement_group import placement_group, remove_placement_group

    from cluster.ray_utils import wait_for_bundles
    total = ray.cluster_resources()["CPU"]
    with pytest.raises(RuntimeError, match=rf"needs \{{CPU: {total + 1:g}\}} and its Ray instance has \{{CPU: {total:g}\}}"):
        wait_for_bundles([{"CPU": total + 1}], "PACK", timeout_s=60, can_grow=False)
    holder = placement_group([{"CPU": total}])  # another job's actors, once what earlier tests held is released
    ray.get(holder.ready(), timeout=120)
    try:
        with pytest.raises(RuntimeError, match=r"could not be placed within 1s \(cluster.wait_for_resources_s\): "
                                               r"free \{CPU: 0\}"):
            wait_for_bundles([{"CPU": 0.5}], "PACK", timeout_s=1, every_s=0.5)
        threading.Timer(1.5, remove_placement_group, args=(holder,)).start()  # the other job ends
        placed = wait_for_bundles([{"CPU": 0.5}], "PACK", timeout_s=60, every_s=0.5)
        remove_placement_group(placed)
    finally:
        remove_placement_group(holder)
    assert "for resources held by other jobs: this run needs {CPU: 0.5}, free {CPU: 0}" in capsys.readouterr().err


def test_a_run_joins_what_it_is_given_or_a_ray_start_cluster_and_another_runs_instance_only_when_asked():
    """Which cluster a run joins (the processes themselves: tests/cluster/test_fault_tolerance.py, the killed
    driver, whose own instance ends with it)."""
    import pytest

    from cluster.local_ray import choose_cluster
    other = {"10.0.0.1:6379"}
    assert choose_cluster("head:6379", "10.0.0.2:6379", other, False) == ("head:6379", "given by cluster.address / RAY_ADDRESS")
    assert choose_cluster(None, "10.0.0.2:6379", other, False) == ("10.0.0.2:6379", "started with `ray start`")
    assert choose_cluster(None, None, other, False) == (None, "")  # another run's private instance: not shared
    assert choose_cluster(None, None, other, True) == ("10.0.0.1:6379", "another run's instance (cluster.join_running)")
    assert choose_cluster(None, None, set(), True) == (None, "")
    assert choose_cluster("local", "10.0.0.2:6379", other, True) == (None, "")  # Ray's word for a new instance
    with pytest.raises(RuntimeError, match=r"several Ray instances run on this machine \(10.0.0.1:6379, 10.0.0.3:6379\)"):
        choose_cluster(None, None, other | {"10.0.0.3:6379"}, True)


def test_rendezvous_ports_lie_below_the_ephemeral_range_and_are_not_handed_out_twice(monkeypatch):
    """A rendezvous port from the kernel's ephemeral range can be taken by an outgoing connection before the rank
    binds it (a learner's TCPStore failed with EADDRINUSE): the ports come from below that range, free when drawn,
    each once (even after it is free again); one that is taken is passed over."""
    import cluster.ray_utils as ray_utils
    assert ephemeral_low() > RENDEZVOUS_PORTS[0]  # Linux's default range starts at 32768
    ports = [free_port() for _ in range(40)]
    assert len(set(ports)) == 40
    assert all(RENDEZVOUS_PORTS[0] <= p < min(RENDEZVOUS_PORTS[1], ephemeral_low()) for p in ports)
    for port in ports[:3]:
        with socket.socket() as s:
            s.bind(("", port))  # each was free when it was drawn: a rank can bind it
    free = next(p for p in range(RENDEZVOUS_PORTS[0] + 5000, RENDEZVOUS_PORTS[1]) if ray_utils._bindable(p))
    monkeypatch.setattr(ray_utils, "RENDEZVOUS_PORTS", (free, free + 1))  # one port left to draw
    assert free_port() == free
    assert free_port() != free  # handed out already: the kernel picks one
    held = socket.socket()
    taken = next(p for p in range(free + 1, RENDEZVOUS_PORTS[1]) if _bind_if_free(held, p))
    held.listen()
    monkeypatch.setattr(ray_utils, "RENDEZVOUS_PORTS", (taken, taken + 1))  # the only port is held by a listener
    try:
        assert free_port() != taken
    finally:
        held.close()


def _bind_if_free(sock: socket.socket, port: int) -> bool:
    """Binds `sock` to `port` on every address when it is free."""
    try:
        sock.bind(("", port))
    except OSError:
        return False
    return True


def test_a_benchmark_process_restarts_itself_with_the_actors_malloc_settings():
    """glibc reads its malloc settings at start-up: a process started without the actors' settings restarts with
    them (its /proc environ, what glibc read, holds them), once, with its arguments."""
    import subprocess
    import sys

    code = ("import sys; from cluster.ray_utils import exec_with_actor_malloc; exec_with_actor_malloc(); "
            "raw = open('/proc/self/environ', 'rb').read().split(b'\\0'); "
            "print(sys.argv[1:], sorted(x.decode() for x in raw if x.startswith(b'MALLOC_')))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", code, "--an-argument"], env=env, capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()
    settings = [f"MALLOC_MMAP_THRESHOLD_={32 << 20}", f"MALLOC_TRIM_THRESHOLD_={64 << 30}"]  # the defaults
    assert out == [f"['--an-argument'] {settings}"]  # one line: the restarted process printed, the first did not
