"""The emulated WAN: network namespaces with TUN devices, and the shaper process between them.

``EmulatedWan`` is a context manager: entering it compiles ``shaper.c`` and
``ccshim.c`` with gcc, creates one namespace per node (a TUN device with the node's
private address, loopback up), starts the shaper and waits for it to attach; leaving
it, also on an exception or Ctrl-C, stops the shaper (by its PID) and deletes the
namespaces it created, and nothing else. Needs root and ``ip`` (iproute2).

Processes run on a node with ``wan.command(node, [...])`` (``ip netns exec``); with
``wan.env(cc)`` their TCP sockets use that congestion control (an ``LD_PRELOAD``
shim, since the namespaces only take reno or bbr as a default).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from benchmarks.wan.links import Link, Node, render_links

__all__ = ["Counters", "EmulatedWan", "parse_counters"]

HERE = Path(__file__).resolve().parent
_READY_S = 10.0
SHAPER_NICE = -5


@dataclass(frozen=True)
class Counters:
    """The shaper's byte counts for one node since it started (IP bytes)."""

    sent: int
    received: int
    drop_loss: int
    drop_queue: int
    drop_down: int


def parse_counters(text: str) -> dict[str, Counters]:
    """The shaper's counters file: ``NAME SENT RECEIVED DROP_LOSS DROP_QUEUE DROP_DOWN``."""
    out = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 6:
            continue  # a partial write is impossible (rename), but never trust a file
        out[fields[0]] = Counters(*(int(f) for f in fields[1:]))
    return out


def _run(*args: str) -> None:
    subprocess.run(args, check=True, stdin=subprocess.DEVNULL, capture_output=True, text=True)


class EmulatedWan:
    """Namespaces + shaper for ``nodes``, links set from ``links`` (changeable while up)."""

    def __init__(
        self,
        nodes: Sequence[Node],
        links: Mapping[str, Link],
        workdir: Path,
        sysctls: Mapping[str, str] | None = None,
    ) -> None:
        """`sysctls`: set in every node's namespace (the kernel's per-namespace TCP
        settings, e.g. net.ipv4.tcp_slow_start_after_idle=0 as the runbooks advise)."""
        self.nodes = list(nodes)
        self.sysctls = dict(sysctls or {})
        self.by_name = {n.name: n for n in self.nodes}
        self.links = dict(links)
        self.workdir = Path(workdir)
        self.links_file = self.workdir / "links.conf"
        self.counters_file = self.workdir / "counters"
        self.log_file = self.workdir / "shaper.log"
        self.shim = self.workdir / "ccshim.so"
        self._created: list[str] = []
        self._shaper: subprocess.Popen[bytes] | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> EmulatedWan:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _start(self) -> None:
        if os.geteuid() != 0:
            raise PermissionError("the WAN benchmark needs root (network namespaces, TUN devices)")
        for tool in ("ip", "gcc"):
            if shutil.which(tool) is None:
                raise FileNotFoundError(f"the WAN benchmark needs `{tool}` on PATH")
        self.workdir.mkdir(parents=True, exist_ok=True)
        shaper = self.workdir / "shaper"
        _run("gcc", "-O2", "-o", str(shaper), str(HERE / "shaper.c"))
        _run("gcc", "-O2", "-shared", "-fPIC", "-o", str(self.shim), str(HERE / "ccshim.c"), "-ldl")
        existing = set(
            subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        )
        for node in self.nodes:
            if node.netns in existing:
                raise FileExistsError(
                    f"network namespace {node.netns!r} already exists (another run, or a "
                    f"crashed one: `ip netns del {node.netns}` if it is yours)"
                )
        for node in self.nodes:
            _run("ip", "netns", "add", node.netns)
            self._created.append(node.netns)
            _run("ip", "-n", node.netns, "link", "set", "lo", "up")
            _run("ip", "-n", node.netns, "tuntap", "add", "dev", node.tun, "mode", "tun")
            _run("ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.tun)
            _run("ip", "-n", node.netns, "link", "set", node.tun, "up", "txqueuelen", "1000")
            for key, value in self.sysctls.items():
                _run("ip", "netns", "exec", node.netns, "sysctl", "-q", "-w", f"{key}={value}")
        self.links_file.write_text(render_links(self.nodes, self.links))
        with self.log_file.open("wb") as log:
            self._shaper = subprocess.Popen(
                [str(shaper), str(self.links_file), str(self.counters_file)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        # The shaper is the network: starved of CPU by the (niced) systems under test
        # or by other work on the machine, it would add delay no real link has. It uses
        # a few % of a core at 100 Mbit/s, so it runs at a higher priority (root).
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, self._shaper.pid, SHAPER_NICE)
        deadline = time.monotonic() + _READY_S
        while b"shaper: ready" not in self.log_file.read_bytes():
            if self._shaper.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the shaper did not start:\n{self.log_file.read_text()}")
            time.sleep(0.05)

    def close(self) -> None:
        """Stop the shaper we started and delete the namespaces we created (idempotent)."""
        if self._shaper is not None:
            with contextlib.suppress(ProcessLookupError):
                self._shaper.send_signal(signal.SIGTERM)
            try:
                self._shaper.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._shaper.kill()
                self._shaper.wait()
            self._shaper = None
        while self._created:
            netns = self._created.pop()
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)

    # -- use ------------------------------------------------------------------------------
    def command(self, node: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``node``'s namespace (same PID: ``ip netns exec`` execs)."""
        return ["ip", "netns", "exec", self.by_name[node].netns, *argv]

    def env(self, cc: str | None) -> dict[str, str]:
        """Environment that gives every TCP socket the congestion control ``cc``."""
        if not cc:
            return {}
        preload = " ".join(filter(None, [str(self.shim), os.environ.get("LD_PRELOAD")]))
        return {"LD_PRELOAD": preload, "WAN_CC": cc}

    def address(self, node: str) -> str:
        return self.by_name[node].address

    def set_link(self, node: str, link: Link) -> None:
        """Change one node's link now (the shaper re-reads its config on SIGHUP)."""
        if self._shaper is None:
            raise RuntimeError("the emulated WAN is not running")
        self.links[node] = link
        tmp = self.links_file.with_suffix(".tmp")
        tmp.write_text(render_links(self.nodes, self.links))
        tmp.replace(self.links_file)
        self._shaper.send_signal(signal.SIGHUP)

    def set_links(self, links: Mapping[str, Link]) -> None:
        for node, link in links.items():
            self.set_link(node, link)

    def counters(self) -> dict[str, Counters]:
        """The shaper's latest counters (refreshed every 50 ms)."""
        try:
            return parse_counters(self.counters_file.read_text())
        except FileNotFoundError:
            return {}
