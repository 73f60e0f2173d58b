"""The host side of the emulated cluster: namespace names, root checks, leftovers, process teardown.

Every namespace and link of a run starts with ``PREFIX`` (``CGX_PS_NETNS_PREFIX``, default
``cgxb-``). A second cluster never starts over leftovers of an earlier run: ``find_leftovers``
lists them and ``cleanup_leftovers`` (``python benchmarks/netcluster.py --cleanup``) removes them,
killing what still runs inside first.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

__all__ = ["PREFIX", "SWITCH_NS", "BRIDGE", "HOST_IFACE", "SUBNET", "ClusterError", "NotRootError", "LeftoversError",
           "cleanup_command", "require_root", "run_cmd", "find_leftovers", "kill_pids", "pid_alive", "netns_pids",
           "cleanup_leftovers"]

# Every namespace and link starts with this; CGX_PS_NETNS_PREFIX gives a run its own (two people
# benchmarking on one machine must not see each other's hosts as leftovers). At most 8 characters:
# Linux link names are 15 at most, and the longest here is PREFIX + "p" + a host number.
PREFIX = os.environ.get("CGX_PS_NETNS_PREFIX", "cgxb-")
if not (0 < len(PREFIX) <= 8 and all(c.isascii() and (c.isalnum() or c == "-") for c in PREFIX)):
    raise SystemExit(f"CGX_PS_NETNS_PREFIX={PREFIX!r}: use 1-8 ASCII letters, digits or '-'")
SWITCH_NS = PREFIX + "sw"
BRIDGE = PREFIX + "br0"
HOST_IFACE = "eth0"
SUBNET = "10.77.0"
# the CLI whose --cleanup removes leftovers (named in every LeftoversError)
NETCLUSTER_CLI = Path(__file__).resolve().with_name("netcluster.py")


class ClusterError(RuntimeError):
    """An ``ip``/``tc`` command failed, or the cluster cannot be used."""


class NotRootError(ClusterError):
    """Namespaces and qdiscs need root (CAP_NET_ADMIN + CAP_SYS_ADMIN)."""


class LeftoversError(ClusterError):
    """``cgxb-`` namespaces or links of an earlier run still exist."""


def cleanup_command() -> str:
    """The exact shell command that removes leftovers of an earlier run."""
    script = NETCLUSTER_CLI
    try:
        script = script.relative_to(Path.cwd())
    except ValueError:
        pass
    return f"{sys.executable} {script} --cleanup"


def require_root() -> None:
    if os.geteuid() != 0:
        raise NotRootError(
            "netcluster needs root (it creates network namespaces, veth pairs, a bridge "
            "and tc qdiscs); rerun as root, e.g. sudo " + " ".join([sys.executable] + sys.argv)
        )
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise ClusterError("netcluster needs the iproute2 tools `ip` and `tc` on PATH")


def run_cmd(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"command failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr.strip()}")
    return proc


def _netns_names() -> list[str]:
    out = run_cmd("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _root_link_names() -> list[str]:
    out = run_cmd("ip", "-o", "link", "show", check=False).stdout
    names = []
    for line in out.splitlines():  # "3: cgxb-p0@if2: <...>"
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def find_leftovers() -> dict[str, list[str]]:
    """``{"netns": [...], "links": [...]}``: ``cgxb-`` objects that exist now."""
    return {
        "netns": [n for n in _netns_names() if n.startswith(PREFIX)],
        "links": [n for n in _root_link_names() if n.startswith(PREFIX)],
    }


def kill_pids(pids: Sequence[int], grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``, each pid given (by id)."""
    pids = [p for p in pids if p > 1 and p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return
        deadline = time.monotonic() + grace_s
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if pid_alive(p)]
            time.sleep(0.05)
        pids = alive


def pid_alive(pid: int) -> bool:
    """True unless the process is gone or a zombie.  Zombies are not reaped
    here, so that Popen.wait() still sees the real exit status."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def netns_pids(ns: str) -> list[int]:
    out = run_cmd("ip", "netns", "pids", ns, check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def cleanup_leftovers(verbose: bool = False) -> dict[str, list[str]]:
    """Remove every ``cgxb-`` namespace (after killing the processes inside it)
    and every ``cgxb-`` link of the root namespace.  Returns what was removed."""
    require_root()
    found = find_leftovers()
    for ns in found["netns"]:
        kill_pids(netns_pids(ns))
    for ns in sorted(found["netns"], key=lambda n: n == SWITCH_NS):  # hosts first
        run_cmd("ip", "netns", "delete", ns, check=False)
        if verbose:
            print(f"removed netns {ns}")
    for link in found["links"]:
        run_cmd("ip", "link", "delete", link, check=False)
        if verbose:
            print(f"removed link {link}")
    return found
