"""Which Ray a run uses, and a local instance that ends with its driver.

A run connects to the cluster it is told about (`cluster.address`, `RAY_ADDRESS`), else joins the one a user
started on this machine with `ray start --head` (as `ray.init()` does), else starts a private instance of its
own. It does not join another run's private instance unless `cluster.join_running: true` asks it to: two runs
sharing one silently compete for its resources.

A private instance's processes die with the driver even when the driver is killed: Ray ties its GCS and raylet
to the process that started them, but the agents the raylet starts (dashboard agent, runtime-env agent) are
left running. `start_reaper` starts a small process that waits for the driver to go (the end of a pipe only the
driver holds) and then ends every process that still has a file open in the instance's session directory.

Run as `python -m cluster.local_ray SESSION_DIR DRIVER_PID`: the reaper itself (standard library only)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_REAPERS: list[subprocess.Popen] = []  # held for the driver's lifetime: their stdin closes when it exits


@dataclass
class RayConnection:
    mode: str  # "connected" (a cluster someone else started) | "local" (this run's private instance)
    note: str  # one line for the run's log: which cluster and what is free there


def init_ray(address: str | None = None, num_cpus: int | None = None, join_running: bool = False) -> RayConnection:
    """Connect to `address` / `RAY_ADDRESS`, else to a `ray start` cluster of this machine, else (or to another
    run's private instance when `join_running`) start a private instance that ends with this process.

    `RAY_AUTH_MODE` is set explicitly (default `disabled`) because a mismatch between the driver and
    `ray job submit` makes the latter fail authentication."""
    import ray

    from cluster.ray_utils import job_runtime_env
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        return RayConnection("connected", f"ray: this process's cluster; {free_resources()}")
    runtime_env = job_runtime_env()
    started, others = _running_instances()
    target, how = choose_cluster(address or os.environ.get("RAY_ADDRESS"), started, others, join_running)
    if target:
        ray.init(address=target, runtime_env=runtime_env, log_to_driver=True)
        return RayConnection("connected", f"ray: joined {_gcs_address()} ({how}); {free_resources()}")
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env)
    session_dir = ray._private.worker.global_worker.node.get_session_dir_path()
    start_reaper(session_dir)
    note = f"ray: started a private instance ({session_dir}); {free_resources()}"
    if others:
        note += (f"; Ray instances of other runs are up on this machine ({', '.join(sorted(others))}): this run "
                 "shares none (cluster.join_running: true joins one)")
    return RayConnection("local", note)


def choose_cluster(given: str | None, started: str | None, others: set[str], join_running: bool
                   ) -> tuple[str | None, str]:
    """The address to join and why, or (None, "") for a private instance of this run's own. `given`: the
    recipe's or RAY_ADDRESS; `started`: a running `ray start` cluster of this machine; `others`: the other
    Ray instances running here (other runs' private ones). `given` "local" (Ray's word for a new instance) asks
    for a private instance as well."""
    if given == "local":
        return None, ""
    if given:
        return given, "given by cluster.address / RAY_ADDRESS"
    if started:
        return started, "started with `ray start`"
    if others and join_running:
        if len(others) > 1:
            raise RuntimeError(f"cluster.join_running: several Ray instances run on this machine "
                               f"({', '.join(sorted(others))}); set cluster.address to the one to join")
        return next(iter(others)), "another run's instance (cluster.join_running)"
    return None, ""


def _gcs_address() -> str:
    import ray
    return ray.get_runtime_context().gcs_address


def _running_instances() -> tuple[str | None, set[str]]:
    """The address a `ray start --head` of this machine recorded (when its GCS is running), and the GCS
    addresses of the other Ray instances running here."""
    from ray._private import services
    running = set(services.find_gcs_addresses())
    recorded = services.find_bootstrap_address(None)
    started = recorded if recorded in running else None
    return started, running - {started}


def free_resources() -> str:
    """What the connected cluster has free of its total, for the resources a run asks for."""
    import ray
    total, free = ray.cluster_resources(), ray.available_resources()
    shown = [k for k in ("CPU", "GPU") if k in total] + sorted(
        k for k in total if k not in ("CPU", "GPU", "memory", "object_store_memory")
        and not k.startswith("node:") and "_group_" not in k)  # placement groups' own resources
    return "free " + ", ".join(f"{k} {free.get(k, 0):g} of {total[k]:g}" for k in shown)


def start_reaper(session_dir: str) -> subprocess.Popen:
    """Start the process that ends this Ray instance's processes once the driver is gone (however it went)."""
    proc = subprocess.Popen([sys.executable, "-m", "cluster.local_ray", session_dir, str(os.getpid())],
                            stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            cwd=str(Path(__file__).resolve().parents[1]))
    _REAPERS.append(proc)
    return proc


def session_processes(session_dir: str) -> list[int]:
    """Processes with a file (a log, a socket path) open under `session_dir`: every process of that Ray instance."""
    prefix = os.path.realpath(session_dir) + os.sep
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{entry.name}/fd")
            if any(_link(f"/proc/{entry.name}/fd/{fd}").startswith(prefix) for fd in fds):
                pids.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def reap(session_dir: str, grace_s: float = 3.0) -> list[int]:
    """SIGTERM every process of the instance, then SIGKILL what is left after `grace_s`; returns their pids."""
    pids = session_processes(session_dir)
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    _signal([p for p in pids if _alive(p)] + session_processes(session_dir), signal.SIGKILL)
    return pids


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] not in ("Z", "X")
    except OSError:
        return False


def main(argv: list[Any]) -> int:
    session_dir, driver = argv[0], int(argv[1])
    # the driver never writes: stdin ends when it has exited (a process it forked may still hold the pipe, so
    # being handed to another parent also counts)
    while os.getppid() == driver:
        ready, _, _ = select.select([sys.stdin], [], [], 0.5)
        if ready and not os.read(sys.stdin.fileno(), 65536):
            break
    time.sleep(1.0)  # Ray's own shutdown (a driver that exits cleanly) goes first
    reap(session_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
