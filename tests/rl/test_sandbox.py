"""The Python tool's sandbox is a boundary (`rl/tools.py`): each probe a hostile model could write is contained, in
bounded time. These run the real bubblewrap sandbox (CI installs `bubblewrap`)."""

import os
import resource
import socket
import uuid
from pathlib import Path

import pytest

from rl import tools
from rl.tools import SandboxUnavailable, run_python

pytestmark = pytest.mark.skipif(os.environ.get(tools.SANDBOX_ENV, "bwrap") != "bwrap",
                                reason="these probe the bubblewrap sandbox")


def test_host_files_and_home_are_out_of_reach_and_only_the_scratch_is_writable(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the host's secret")
    home, outside = Path.home(), Path(f"/usr/looprl-probe-{uuid.uuid4().hex}")
    probe = (f"import os\n"
             f"for path in ['/etc/passwd', {str(secret)!r}, {str(home / '.bashrc')!r}]:\n"
             f"    try:\n        print(path, open(path).read()[:20])\n"
             f"    except OSError as exc:\n        print(path, type(exc).__name__)\n"
             f"for path in [{str(outside)!r}, {str(tmp_path / 'written')!r}, 'scratch.txt']:\n"
             f"    try:\n        open(path, 'w').write('x'); print(path, 'written')\n"
             f"    except OSError as exc:\n        print(path, type(exc).__name__)\n"
             f"print(sorted(os.listdir({str(home)!r})) if os.path.isdir({str(home)!r}) else 'no home')\n")
    try:
        result = run_python(probe)
        written_outside = outside.exists()
    finally:
        outside.unlink(missing_ok=True)
    assert result.ok, result
    assert "the host's secret" not in result.output and "root:" not in result.output
    assert "/etc/passwd FileNotFoundError" in result.output
    assert "scratch.txt written" in result.output and f"{outside} written" not in result.output
    assert not (tmp_path / "written").exists() and not written_outside
    assert ".bashrc" not in result.output.split("\n")[-2]  # the home directory holds at most the interpreter


def test_the_callers_environment_and_processes_are_invisible_and_cannot_be_signalled(monkeypatch):
    monkeypatch.setenv("LOOPRL_PROBE_SECRET", "s3cr3t-in-the-parent")
    probe = (f"import os, glob\n"
             f"print('env', 'LOOPRL_PROBE_SECRET' in os.environ)\n"
             f"found = [p for p in glob.glob('/proc/[0-9]*/environ') if b's3cr3t' in open(p, 'rb').read()]\n"
             f"print('found', found)\n"
             f"print('pids', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
             f"try:\n    os.kill({os.getpid()}, 0); print('signalled the caller')\n"
             f"except OSError as exc:\n    print('kill', type(exc).__name__)\n")
    result = run_python(probe)
    assert result.ok, result
    assert "s3cr3t" not in result.output and "env False" in result.output and "found []" in result.output
    assert "signalled the caller" not in result.output and "kill ProcessLookupError" in result.output
    pids = eval(result.output.split("pids ")[1].split("\n")[0])
    assert max(pids) < 10  # a PID namespace of its own: bwrap's init and the tool


def test_no_network_by_raw_socket_by_child_process_or_by_setns_back_to_the_host():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    probe = (f"import _socket, ctypes, os, subprocess, sys\n"
             f"s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
             f"try:\n    s.connect(('127.0.0.1', {port})); print('raw connected')\n"
             f"except OSError as exc:\n    print('raw', type(exc).__name__)\n"
             f"child = subprocess.run([sys.executable, '-c', \"import socket; socket.create_connection(('127.0.0.1', "
             f"{port}), timeout=2); print('child connected')\"], capture_output=True, text=True)\n"
             f"print('child', child.stdout.strip() or 'refused')\n"
             f"libc = ctypes.CDLL(None, use_errno=True)\n"
             f"for target in ['/proc/1/ns/net', '/proc/{os.getpid()}/ns/net']:\n"
             f"    try:\n        fd = os.open(target, os.O_RDONLY)\n"
             f"        print(target, 'setns', libc.setns(fd, 0x40000000), ctypes.get_errno())\n"
             f"    except OSError as exc:\n        print(target, type(exc).__name__)\n")
    try:
        result = run_python(probe, timeout_s=10)
    finally:
        listener.close()
    assert result.ok, result
    assert "connected" not in result.output.replace("child refused", ""), result.output
    assert "raw ConnectionRefusedError" in result.output or "raw OSError" in result.output
    assert "/proc/1/ns/net setns -1 1" in result.output  # EPERM: no capability to enter a namespace
    assert f"/proc/{os.getpid()}/ns/net FileNotFoundError" in result.output  # the host's processes are not there


def test_a_fork_storm_is_bounded_and_leaves_nothing_behind():
    marker = uuid.uuid4().hex
    probe = (f"import os, time\nn = 0\n"
             f"for i in range(200):\n"
             f"    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
             f"    if pid == 0:\n        time.sleep(30)  # {marker}\n        os._exit(0)\n"
             f"    n += 1\nprint('forked', n)\n")
    result = run_python(probe, timeout_s=10, max_processes=16)
    assert result.ok, result
    assert int(result.output.split()[-1]) < 16
    assert _host_processes_with(marker) == []  # the tree went with the call


def test_the_memory_limit_holds_for_the_whole_tree():
    probe = ("import os, time\nkids = []\n"
             "for i in range(4):\n    pid = os.fork()\n"
             "    if pid == 0:\n        x = bytearray(400 << 20)\n"
             "        for j in range(0, len(x), 4096): x[j] = 1\n"
             "        time.sleep(1); os._exit(0)\n    kids.append(pid)\n"
             "print('killed', sum(os.waitpid(p, 0)[1] != 0 for p in kids))\n")
    result = run_python(probe, timeout_s=20, memory_mb=512)
    assert result.ok, result
    assert int(result.output.split()[-1]) >= 3  # 4 x 400 MB does not fit in 512 MB for the tree


@pytest.mark.timeout(60)  # a child that outlives the deadline would hold the call for 300 s
def test_a_child_that_calls_setsid_ends_with_the_call():
    marker = uuid.uuid4().hex
    probe = (f"import os, sys, time\n"
             f"if os.fork() == 0:\n    os.setsid()\n"
             f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(300)  # {marker}'])\n"
             f"time.sleep(300)\n")
    result = run_python(probe, timeout_s=2)
    assert not result.ok and result.error == "timed out after 2 s"
    assert _host_processes_with(marker) == []


def test_a_flood_of_output_is_stopped_without_buffering_it():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = run_python("import sys\nfor _ in range(100): sys.stdout.write('x' * 1_000_000)\n", timeout_s=30)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert not result.ok and result.error.startswith("stopped: printed more than")
    assert len(result.output) < 3000 and grown_mib < 50


def test_without_bubblewrap_tools_are_refused_naming_the_key_that_allows_the_unsafe_mode(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a host without bwrap
    tools.bwrap_problem.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match=r"bwrap.*not installed.*rollout\.sandbox: process"):
            run_python("print(1)")
        monkeypatch.setenv(tools.SANDBOX_ENV, "process")  # what the key does: a plain child process
        assert run_python("print(1)").output == "1\n"
    finally:
        monkeypatch.undo()
        tools.bwrap_problem.cache_clear()


def test_a_recipe_whose_environment_runs_model_code_is_refused_before_start_up_without_the_sandbox(
        monkeypatch, tmp_path):
    from rl.recipe import ConfigError
    from rl.validation import check_sandbox
    monkeypatch.setenv("PATH", str(tmp_path))
    tools.bwrap_problem.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"rollout\.env: 'calculator' runs model-written code.*rollout\.sandbox"):
            check_sandbox("calculator", "bwrap")
        check_sandbox("calculator", "process")  # asked for explicitly
    finally:
        monkeypatch.undo()
        tools.bwrap_problem.cache_clear()
    check_sandbox("calculator", "bwrap")  # bubblewrap is here


def test_a_cgroup_that_cannot_be_set_up_is_not_left_behind():
    """A limit the kernel refuses (a negative process count) makes no cgroup, and leaves no directory behind."""
    before = _tool_cgroups()
    made = tools.TreeLimits.create(256 << 20, 8)
    if made is None:
        pytest.skip("this host lets looprl create no cgroup (v1 or v2): the sandbox limits each process instead and "
                    "has no cgroup to clean up")
    made.remove()
    assert tools.TreeLimits.create(256 << 20, -5) is None
    assert _tool_cgroups() == before


def _tool_cgroups() -> set[str]:
    return {str(p) for p in Path("/sys/fs/cgroup").rglob("looprl-tool-*")}


def _host_processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found
