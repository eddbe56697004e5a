"""An app's processes: is the recorded one alive and still ours, and stopping all of them.

Each app runs in a session of its own, so its master and workers form one process group:
``stop_record`` sends SIGTERM to the master, then SIGKILL to the group. Liveness reads
``/proc`` where there is one, so that zombies count as dead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from launcher.console import err, say
from launcher.deployment import bind_address
from launcher.rundir import AppRecord, remove_record

#: How long ``down``/``stop`` wait after SIGTERM before SIGKILL of the whole process group.
STOP_GRACE_SECONDS: float = 20.0


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def pid_alive(pid: int) -> bool:
    """Tell whether ``pid`` runs. Zombies count as dead.

    Zombies matter here: an app's master is re-parented when start_app exits, and where the new
    parent (some container inits) never reaps, a dead master would look alive to kill(pid, 0).
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not Path("/proc/self/stat").exists():
        return True  # no procfs (not Linux): kill(pid, 0) is all we know
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        stat = _proc_stat(int(entry.name))
        if stat and stat[0] not in ("Z", "X") and int(stat[2]) == pgid:
            members.append(int(entry.name))
    return members


def is_ours(record: AppRecord) -> bool:
    """Guard against pid reuse: the live process must be the gunicorn we started."""
    try:
        cmdline = Path(f"/proc/{record.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return pid_alive(record.pid)  # no procfs: trust the record
    args = [a.decode(errors="replace") for a in cmdline]
    if "streamlit" in args:  # the chat UI: ``python -m streamlit run ... --server.port PORT``
        return str(record.port) in args
    return "gunicorn" in " ".join(args) and bind_address(record.host, record.port) in args


def _wait_gone(pid: int, timeout: float, popen: subprocess.Popen[bytes] | None) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if popen is not None:
            popen.poll()  # reap our own child, or it would linger as a zombie
        if not pid_alive(pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def stop_record(
    record: AppRecord,
    run_dir: Path,
    grace: float = STOP_GRACE_SECONDS,
    popen: subprocess.Popen[bytes] | None = None,
) -> bool:
    """Stop one app: SIGTERM to the gunicorn master, then SIGKILL to its process group.

    Returns True when nothing of the app is left running. Removes the record and pid file.
    """
    ours = pid_alive(record.pid) and is_ours(record)
    if not ours:
        say(f"  {record.name}: not running (pid {record.pid} is gone); record removed")
    else:
        say(f"  {record.name}: stopping pid {record.pid} (SIGTERM) ...")
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.pid, signal.SIGTERM)
        if not _wait_gone(record.pid, grace, popen):
            say(f"  {record.name}: still running after {grace:.0f} s, sending SIGKILL")
    # Workers of a master that died hard would be orphans in the group: kill the whole group.
    if ours or group_members(record.pgid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(record.pgid, signal.SIGKILL)
        _wait_gone(record.pid, 5.0, popen)
        deadline = time.monotonic() + 5.0
        while group_members(record.pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
    if popen is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=1)
    left = group_members(record.pgid) if ours else []
    if pid_alive(record.pid) and ours:
        left.append(record.pid)
    remove_record(run_dir, record.name)
    if left:
        err(f"{record.name}: processes still running: {sorted(set(left))}")
        return False
    if ours:
        say(f"  {record.name}: stopped")
    return True
