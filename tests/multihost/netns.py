"""Test hosts as Linux network namespaces on one bridge, and the faults a network can have.

Each host is a namespace with one interface (``eth0``, an address in :data:`SUBNET`) whose veth
peer sits on a bridge in the root namespace; the bridge has the first address, so the test
process itself is a host on that network (the callers). Nothing else of the machine's network
is touched: the bridge, the veths and the namespaces carry a per-run prefix and are all
removed at teardown. Faults are applied to one host's link: down (``ip link``), random loss
and delay (``tc netem`` when the kernel has it, else an NFQUEUE program), silent drop (iptables
DROP: connections hang instead of being refused).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

#: A private range no real network here uses (RFC 1918); the bridge takes ``.1``.
SUBNET = "10.213.0"
REPO_ROOT = Path(__file__).resolve().parents[2]
#: The netfilter queue the delay program reads.
NFQUEUE_NUMBER = 7


class NetnsUnavailable(Exception):
    """Namespaces cannot be made here (not root, no iproute2, no kernel support)."""


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command (``ip``, ``tc``, ``iptables``) and return its result."""
    result = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr}")
    return result


def has_netem() -> bool:
    """True when the kernel has the netem qdisc (some VM kernels are built without it)."""
    config = Path("/proc/config.gz")
    if config.exists():
        import gzip

        return "CONFIG_NET_SCH_NETEM=" in gzip.decompress(config.read_bytes()).decode()
    return True  # no config to read: try it, and let tc say no


@dataclass
class Host:
    """One test host: a namespace, its address and the root-side end of its veth."""

    name: str
    namespace: str
    address: str
    veth: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    #: The program that makes a fault (the NFQUEUE delay), ended by :meth:`heal`.
    fault_process: subprocess.Popen[bytes] | None = None

    def exec_args(self, *args: str) -> list[str]:
        """``args`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *args]

    def spawn(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        """Start a Python program (``args`` after the interpreter) on this host."""
        with log.open("ab") as out:
            process = subprocess.Popen(
                self.exec_args(sys.executable, *args),
                cwd=REPO_ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # its own process group: teardown ends exactly it
            )
        self.processes.append(process)

    def stop_processes(self) -> None:
        """End the programs started on this host (SIGTERM, then SIGKILL)."""
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        self.processes.clear()

    # -- faults ------------------------------------------------------------------------------

    def link(self, is_up: bool) -> None:
        """Cut the host off the bridge (its cable pulled) or plug it back."""
        run("ip", "link", "set", self.veth, "up" if is_up else "down")

    def lose(self, percent: int, delay_ms: int, log: Path) -> str:
        """Drop ``percent`` % of packets and delay the rest ``delay_ms``, each way.

        ``tc netem`` where the kernel has it; else the same per-packet behaviour from an
        NFQUEUE verdict program (``tests.multihost.delay_queue``) on this host. Returns what
        was applied.
        """
        spec = ["delay", f"{delay_ms}ms", "loss", f"{percent}%"]
        if has_netem():
            try:
                run(*self.exec_args("tc", "qdisc", "add", "dev", "eth0", "root", "netem", *spec))
                run("tc", "qdisc", "add", "dev", self.veth, "root", "netem", *spec)
                return f"tc netem {' '.join(spec)} (both ends of the link)"
            except RuntimeError:  # no config to tell, and tc says no: the queue program
                self.heal()
        args = ["-m", "tests.multihost.delay_queue", "--queue", str(NFQUEUE_NUMBER)]
        args += ["--delay", str(delay_ms / 1000), "--loss", str(percent / 100)]
        self.spawn(args, log)
        self.fault_process = self.processes[-1]
        deadline = time.monotonic() + 30
        while "ready" not in log.read_text():
            if self.fault_process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"delay_queue did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        # Rules only once the program listens: a queue without a reader drops everything.
        queue = ["-j", "NFQUEUE", "--queue-num", str(NFQUEUE_NUMBER)]
        run(*self.exec_args("iptables", "-A", "INPUT", "-i", "eth0", *queue))
        run(*self.exec_args("iptables", "-A", "OUTPUT", "-o", "eth0", *queue))
        return f"NFQUEUE verdicts (no netem in this kernel): {' '.join(spec)} each way"

    def drop_all(self) -> None:
        """Drop every packet on eth0 silently: peers' connections hang (no RST, no ICMP)."""
        run(*self.exec_args("iptables", "-A", "INPUT", "-i", "eth0", "-j", "DROP"))
        run(*self.exec_args("iptables", "-A", "OUTPUT", "-o", "eth0", "-j", "DROP"))

    def heal(self) -> None:
        """Undo every fault: link up, no qdisc, no firewall rule."""
        self.link(True)
        run(*self.exec_args("tc", "qdisc", "del", "dev", "eth0", "root"), check=False)
        run("tc", "qdisc", "del", "dev", self.veth, "root", check=False)
        run(*self.exec_args("iptables", "-F"), check=False)
        process, self.fault_process = self.fault_process, None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=10)
            self.processes.remove(process)


class TestNetwork:
    """A bridge and the test hosts on it; :meth:`close` removes all of it."""

    __test__ = False  # not a pytest test class despite its name

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.bridge = f"{prefix}br"
        self.hosts: dict[str, Host] = {}
        self.etc = Path("/etc/netns")

    @staticmethod
    def preflight() -> None:
        """Raise NetnsUnavailable when this process cannot make namespaces at all."""
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (run the tests as root)")
        for tool in ("ip", "tc", "iptables"):
            if shutil.which(tool) is None:
                raise NetnsUnavailable(f"{tool!r} is missing (apt-get install iproute2 iptables)")

    def open(self) -> TestNetwork:
        """Create the bridge (with the callers' address ``.1``); raises NetnsUnavailable."""
        self.preflight()
        self.close()  # leftovers of a killed run with the same prefix
        try:
            run("ip", "link", "add", self.bridge, "type", "bridge")
        except RuntimeError as exc:
            raise NetnsUnavailable(f"cannot create a bridge: {exc}") from None
        run("ip", "addr", "add", f"{SUBNET}.1/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        return self

    def add_host(self, name: str, index: int) -> Host:
        """A new host ``name`` with address ``SUBNET.index`` on the bridge."""
        namespace, veth = f"{self.prefix}{name}", f"{self.prefix}v{index}"
        run("ip", "netns", "add", namespace)
        host = Host(name, namespace, f"{SUBNET}.{index}", veth)
        self.hosts[name] = host
        run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        run("ip", "link", "set", veth, "master", self.bridge, "up")
        run("ip", "-n", namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        run("ip", "-n", namespace, "link", "set", "eth0", "up")
        run("ip", "-n", namespace, "link", "set", "lo", "up")
        return host

    def hosts_file(self, host: Host) -> Path:
        """``/etc/netns/<namespace>/hosts``: ``ip netns exec`` mounts it over ``/etc/hosts``."""
        return self.etc / host.namespace / "hosts"

    def write_hosts(self, host: Host, entries: dict[str, list[str]]) -> None:
        """Set the host's ``/etc/hosts`` (name -> addresses), in place.

        Written through the same inode (truncate, not replace): the bind mount of a running
        program keeps pointing at that inode, so its next lookup sees the new content.
        """
        path = self.hosts_file(host)
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost"]
        lines += [
            f"{address} {name}" for name, addresses in entries.items() for address in addresses
        ]
        with path.open("r+" if path.exists() else "w") as out:
            out.truncate(0)
            out.write("\n".join(lines) + "\n")

    def close(self) -> None:
        """Stop the hosts' programs, remove namespaces, veths, bridge and /etc/netns entries."""
        for host in self.hosts.values():
            host.stop_processes()
        listed = run("ip", "netns", "list", check=False).stdout.split()
        for namespace in [name for name in listed if name.startswith(self.prefix)]:
            run("ip", "netns", "del", namespace, check=False)  # its eth0 and the veth go too
            shutil.rmtree(self.etc / namespace, ignore_errors=True)
        links = run("ip", "-o", "link", "show", check=False).stdout
        for line in links.splitlines():
            name = line.split(":")[1].strip().split("@")[0]
            if name.startswith(self.prefix):
                run("ip", "link", "del", name, check=False)
        self.hosts.clear()
        with contextlib.suppress(OSError):  # only when empty: other namespaces may use it
            self.etc.rmdir()
