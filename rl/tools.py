"""Model-written Python, run in a sandbox that is a boundary: `run_python(code)`.

The default sandbox (`rollout.sandbox: bwrap`) runs the code with bubblewrap (`bwrap`, Debian's `bubblewrap`) in
new user, PID, mount, network, IPC, UTS and cgroup namespaces it cannot leave: as an unprivileged user (uid 65534)
with every capability dropped and no nested user namespaces (so no `setns` back into the host's), a `/proc` of its
own namespace (no host process is visible, none can be signalled), no network but an unconnected loopback, and a
file system that holds only the interpreter and its packages, read-only, a fresh `/dev`, and an empty scratch
directory (`/scratch`, the working directory, a size-capped tmpfs). No environment variable reaches it.

Limits hold for the whole process tree: the total memory of all its processes and their number (a cgroup of its own
per call, v2 or v1, where the host lets looprl create one), CPU seconds per process, and the wall time — at the
deadline the sandbox's PID namespace is torn down, which also ends children that called `setsid()`. Output is read
incrementally: it is truncated to `max_output_chars`, and a tool that prints more than 1 MiB is stopped (output is
never buffered whole). A tool that hangs,
crashes, runs out of memory or prints too much returns a `ToolResult` with `ok=False` and the reason: it never
hangs the rollout.

Where bubblewrap is missing or cannot create namespaces, tools are refused (`SandboxUnavailable`) with a message
naming `rollout.sandbox`; `rollout.sandbox: process` runs the code in a plain child process with per-process limits
only, which is not a boundary (model code can read the host's files and environment): for trusted code only.
Without a writable cgroup, memory is limited per process (`RLIMIT_AS`) and the process count is not bounded; the
first call says so once.
"""

from __future__ import annotations

import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

SANDBOXES = ("bwrap", "process")
SANDBOX_ENV = "LOOPRL_SANDBOX"  # how the mode reaches every process that runs tools (set from rollout.sandbox)
MAX_READ_BYTES = 1 << 20  # output past this stops the tool; below it, output is only truncated to max_output_chars
SCRATCH_MB = 64  # the scratch tmpfs inside the sandbox (counted in the tree's memory where a cgroup holds it)

# In the plain-process mode only: Python-level network access fails (no boundary: a raw `_socket` still connects).
_NO_NETWORK = (
    "import socket as _s\n"
    "def _refuse(*a, **k):\n"
    "    raise OSError('network access is disabled in the looprl sandbox')\n"
    "_s.socket.connect = _refuse\n_s.socket.connect_ex = _refuse\n_s.create_connection = _refuse\n"
    "_s.getaddrinfo = _refuse\ndel _s, _refuse\n"
)


class SandboxUnavailable(RuntimeError):
    """The recipe asks for the bubblewrap sandbox and this host cannot provide it."""


@dataclass
class ToolResult:
    ok: bool  # ran to completion with exit code 0
    output: str  # stdout (and stderr when it failed), truncated
    error: str | None = None  # why it failed: timeout, killed by a signal, exit code, memory, output size


def sandbox_mode() -> str:
    """The mode tools run in here: `LOOPRL_SANDBOX` (set from the recipe's `rollout.sandbox`), `bwrap` by default."""
    mode = os.environ.get(SANDBOX_ENV, "bwrap")
    if mode not in SANDBOXES:
        raise SandboxUnavailable(f"rollout.sandbox must be one of {SANDBOXES}, got {mode!r}")
    return mode


@functools.cache
def bwrap_problem() -> str | None:
    """Why the bubblewrap sandbox cannot run on this host (None when it can): checked once per process by running
    `true` in it."""
    exe = shutil.which("bwrap")
    if exe is None:
        return "bubblewrap (`bwrap`) is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    done = subprocess.run([*bwrap_command(), "/bin/true"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return f"bubblewrap cannot create its namespaces here: {done.stderr.strip()[:300]}"
    return None


def require_sandbox(mode: str | None = None) -> None:
    """Raise `SandboxUnavailable`, naming the recipe key, when tools cannot run in `mode` (default: the configured
    one) on this host."""
    if (mode or sandbox_mode()) == "bwrap" and (problem := bwrap_problem()) is not None:
        raise SandboxUnavailable(
            f"model-written code runs in the bubblewrap sandbox and {problem}. Install it, or set "
            f"rollout.sandbox: process to run tools in a plain child process, which is NOT a boundary (the code "
            f"can read this host's files and environment): for trusted code only")


def _interpreter_paths() -> list[str]:
    """What the sandbox mounts read-only: the interpreter's installation and its environment's packages."""
    paths = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), sys.prefix}
    return sorted(p for p in paths if p and p != "/")


def bwrap_command() -> list[str]:
    """bubblewrap's arguments: the namespaces, the user, the read-only interpreter, and the size-capped tmpfs
    scratch directories (`/scratch`, the working directory, and `/tmp`)."""
    cmd = ["bwrap", "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534", "--cap-drop", "ALL",
           "--disable-userns", "--die-with-parent", "--new-session", "--clearenv", "--hostname", "sandbox",
           "--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev",
           "--size", str(SCRATCH_MB << 20), "--tmpfs", "/tmp",
           "--size", str(SCRATCH_MB << 20), "--perms", "0777", "--tmpfs", "/scratch", "--chdir", "/scratch"]
    for top in ("bin", "lib", "lib64", "lib32", "sbin"):  # merged-/usr systems link these into /usr
        path = Path("/") / top
        if path.is_symlink():
            cmd += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            cmd += ["--ro-bind", str(path), str(path)]
    for path in _interpreter_paths():
        if not path.startswith("/usr/"):
            cmd += ["--ro-bind", path, path]
    return [*cmd, "--"]


class TreeLimits:
    """A cgroup of its own for one call's process tree (memory and process count of all its processes together),
    under the caller's cgroup; v2 (`memory.max`, `pids.max`) or v1 (the `memory` and `pids` hierarchies). `None`
    from `create` when the host does not let this process make one."""

    def __init__(self, dirs: list[Path], version: int):
        self.dirs, self.version = dirs, version

    @classmethod
    def create(cls, memory_bytes: int, max_processes: int) -> TreeLimits | None:
        name = f"looprl-tool-{uuid.uuid4().hex[:12]}"
        v2 = Path("/sys/fs/cgroup")
        if {"memory", "pids"} <= set(_read(v2 / "cgroup.controllers").split()):
            plan = [(v2 / _own_cgroup(""), {"memory.max": memory_bytes, "memory.swap.max": 0,
                                            "pids.max": max_processes})]
        else:
            plan = [(_v1_parent(controller), settings) for controller, settings in (
                ("memory", {"memory.limit_in_bytes": memory_bytes}), ("pids", {"pids.max": max_processes}))]
        made = cls([], 2 if len(plan) == 1 else 1)
        try:
            for parent, settings in plan:
                (parent / name).mkdir()
                made.dirs.append(parent / name)
                for key, value in settings.items():
                    _write(parent / name / key, value, missing_ok=key == "memory.swap.max")
            return made
        except OSError:  # not ours to make, or a controller not enabled here: leave nothing behind
            made.remove()
            return None

    def enter(self) -> None:
        """Move the calling process (a child before it execs) into the cgroup."""
        for d in self.dirs:
            _write(d / "cgroup.procs", os.getpid())

    def oom_killed(self) -> bool:
        events = self.dirs[0] / ("memory.events" if self.version == 2 else "memory.oom_control")
        for line in _read(events).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and int(value) > 0:
                return True
        return False

    def remove(self) -> None:
        """Kill whatever is left in the cgroup and remove it."""
        for _ in range(100):
            pids = {int(p) for d in self.dirs for p in _read(d / "cgroup.procs").split()}
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                for d in self.dirs:
                    if d.exists():  # a retry after one hierarchy's directory went
                        d.rmdir()
                return
            except OSError:
                time.sleep(0.01)


def _own_cgroup(controller: str) -> str:
    """This process's cgroup path in a hierarchy (`""`: the v2 one), relative to its root."""
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers.split(",") == [controller]:
            return path.lstrip("/")
    return ""


def _v1_parent(controller: str) -> Path:
    """Where a cgroup v1 child of this process's cgroup goes in `controller`'s hierarchy (its root when this
    process's own cgroup is not visible here)."""
    root = Path("/sys/fs/cgroup") / controller
    own = root / _own_cgroup(controller)
    return own if own.is_dir() else root


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _write(path: Path, value: object, missing_ok: bool = False) -> None:
    try:
        path.write_text(str(value))
    except FileNotFoundError:
        if not missing_ok:
            raise


@functools.cache
def _warn_per_process_limits() -> None:
    warnings.warn("the Python tool's sandbox found no writable cgroup here: its memory limit holds per process "
                  "(RLIMIT_AS) and the number of processes is not bounded", RuntimeWarning, stacklevel=3)


def _preexec(limits: TreeLimits | None, cpu_s: int, memory_mb: int):
    def apply() -> None:
        import resource
        os.setsid()  # its own process group: the deadline kills bwrap, which tears the sandbox's namespace down
        if limits is not None:
            limits.enter()
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _read_bounded(proc: subprocess.Popen, stdin: str, deadline: float, max_bytes: int) -> tuple[bytes, bytes, str]:
    """stdout and stderr as they come, until the process ends, the deadline passes or more than `max_bytes` came
    (then `why` says which); never holds more than `max_bytes` + one read of each."""
    if stdin:
        proc.stdin.write(stdin.encode())
    proc.stdin.close()
    buffers = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for stream in buffers:
        os.set_blocking(stream.fileno(), False)
        sel.register(stream, selectors.EVENT_READ)
    why = ""
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            why = "timeout"
            break
        for key, _ in sel.select(timeout=min(left, 0.5)):
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buffers[key.fileobj] += chunk
            if len(buffers[proc.stdout]) + len(buffers[proc.stderr]) > max_bytes:
                why = "output"
        if why:
            break
    sel.close()
    return bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr]), why


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} characters cut]"


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 2000,
               stdin: str = "", max_processes: int = 32) -> ToolResult:
    """Run `code` under the sandbox and limits above: `timeout_s` of wall time for the whole tree, `memory_mb` for
    all its processes together (per process without a cgroup), at most `max_processes` processes."""
    require_sandbox()
    if sandbox_mode() == "process":  # not a boundary: per-process limits in a scratch working directory
        with _Scratch() as scratch:
            return _run([sys.executable, "-I", "-c", _NO_NETWORK + code], stdin, None, timeout_s, memory_mb,
                        max_output_chars, scratch.path)
    limits = TreeLimits.create(memory_mb << 20, max_processes)
    if limits is None:
        _warn_per_process_limits()
    try:
        return _run([*bwrap_command(), sys.executable, "-I", "-c", code], stdin, limits, timeout_s, memory_mb,
                    max_output_chars, None)
    finally:
        if limits is not None:
            limits.remove()


def _run(cmd: list[str], stdin: str, limits: TreeLimits | None, timeout_s: float, memory_mb: int,
         max_output_chars: int, cwd: Path | None) -> ToolResult:
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                            cwd=cwd, preexec_fn=_preexec(limits, max(1, int(timeout_s) + 1), memory_mb))
    out, err, why = _read_bounded(proc, stdin, time.monotonic() + timeout_s, max(MAX_READ_BYTES, 4 * max_output_chars))
    if why:
        os.killpg(proc.pid, signal.SIGKILL)  # bwrap dies, its namespace's processes with it (--die-with-parent)
    code = proc.wait()
    text_out, text_err = out.decode(errors="replace"), err.decode(errors="replace")
    if why == "timeout":
        return ToolResult(False, _truncate(text_out, max_output_chars), f"timed out after {timeout_s:g} s")
    if why == "output":
        return ToolResult(False, _truncate(text_out, max_output_chars),
                          f"stopped: printed more than {max(MAX_READ_BYTES, 4 * max_output_chars)} bytes")
    if code == 0:
        return ToolResult(True, _truncate(text_out, max_output_chars))
    if (limits is not None and limits.oom_killed()) or "MemoryError" in text_err:
        reason = f"out of memory (limit {memory_mb} MiB)"
    elif code < 0 or code > 128:
        reason = f"killed by signal {signal.Signals(-code if code < 0 else code - 128).name}"
    else:
        reason = f"exit code {code}"
    return ToolResult(False, _truncate(text_out + text_err, max_output_chars), reason)


class _Scratch:
    """The plain-process mode's working directory: empty, removed afterwards."""

    def __enter__(self) -> _Scratch:
        import tempfile
        self.path = Path(tempfile.mkdtemp(prefix="looprl-tool-"))
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
