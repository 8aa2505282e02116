"""Peak resident memory of whole process trees, sampled in a background thread.

Federated runtimes (Flower's deployment engine, fedtrain's own gRPC runtime) spread
one logical role over several OS processes: a SuperLink forks a SuperExec that forks
a fresh ServerApp, a SuperNode forks a ClientApp per message, and so on. Measuring
only the process we launched would miss most of the memory, so this module samples
the RSS of each root *and all its descendants* and keeps per-role and total peaks.

Sampling (not ``getrusage``) is deliberate: ``ru_maxrss`` of children is only known
after they are reaped, is a max over single processes rather than of a sum, and the
short-lived per-message children of Flower are never our direct children.

As a cross-check on sampling (a spike shorter than the interval can be missed),
on Linux the kernel's per-process high-water mark (``VmHWM``) is also recorded;
``hwm_bound()`` sums it per role, an upper bound on the true tree peak because the
per-process peaks need not coincide. If ``peaks()`` is far below it, sample faster.

Usage::

    with TreeRssSampler({"server": server.pid, "site-0": site0.pid}) as sampler:
        ...  # run the workload
    sampler.peaks()       # {"server": 123456789, "site-0": 98765432}
    sampler.peak_total()  # peak of the sum over all roles at one sampling instant
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterable, Mapping
from types import TracebackType

import psutil

__all__ = ["TreeRssSampler", "tree_processes", "tree_rss"]


def tree_processes(root: psutil.Process) -> list[psutil.Process]:
    """Return ``root`` and all its live descendants (empty if ``root`` has exited)."""
    try:
        return [root, *root.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def processes_with_env(key: str, value: str) -> list[psutil.Process]:
    """Every live process (not this one) whose environment has ``key=value``.

    Children inherit the environment, so a per-run value finds everything a run
    started even after it left its process group or was re-parented to init; other
    users' processes (which we may not read) are skipped.
    """
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(key) == value and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def stop_processes(
    popens: Iterable[subprocess.Popen[bytes]],
    extra: Iterable[psutil.Process],
    env_key: str,
    env_value: str,
    grace_s: float = 5.0,
) -> list[str]:
    """SIGTERM, then SIGKILL, every process group in ``popens`` (started with
    ``start_new_session=True``), every process in ``extra`` and every process whose
    environment has ``env_key=env_value``; returns descriptions of survivors (should
    be none). SIGTERM first so daemons that handle it leave cleanly.
    """
    popens = list(popens)
    targets: dict[int, psutil.Process] = {}
    # Collect descendants before any parent dies, or they get re-parented to init.
    for popen in popens:
        with contextlib.suppress(psutil.NoSuchProcess):
            for proc in tree_processes(psutil.Process(popen.pid)):
                targets[proc.pid] = proc
    for proc in [*extra, *processes_with_env(env_key, env_value)]:
        targets.setdefault(proc.pid, proc)

    def signal_all(sig: signal.Signals) -> None:
        for popen in popens:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(popen.pid, sig)  # start_new_session: pid is the group id
        for proc in targets.values():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                proc.send_signal(sig)  # psutil refuses a PID reused by someone else

    signal_all(signal.SIGTERM)
    _, alive = psutil.wait_procs(list(targets.values()), timeout=grace_s)
    if alive:
        signal_all(signal.SIGKILL)
        psutil.wait_procs(alive, timeout=grace_s)
    for popen in popens:
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=grace_s)
    survivors = {p.pid: p for p in targets.values() if _alive(p)}
    survivors.update({p.pid: p for p in processes_with_env(env_key, env_value)})
    return [_describe(p) for p in survivors.values()]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid}:{' '.join(proc.cmdline())[:120]}"
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return str(proc.pid)


def tree_rss(pid: int) -> int:
    """One-shot RSS in bytes of ``pid`` plus all its descendants (0 if it is gone)."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in tree_processes(root):
        total += _rss(proc)
    return total


def _vm_hwm(pid: int) -> int | None:
    """Peak RSS (``VmHWM``) of one process in bytes from /proc; ``None`` off Linux."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _rss(proc: psutil.Process) -> int:
    """RSS of one process; a process that exits between listing and reading counts 0."""
    try:
        return int(proc.memory_info().rss)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return 0


class TreeRssSampler:
    """Sample the RSS of named process trees every ``interval_s`` seconds.

    Each role is a root PID; the role's figure is the RSS sum over the root and all
    its descendants at one instant. ``peaks()`` is the maximum of that figure per
    role, ``peak_total()`` the maximum of the sum over roles at one instant (which is
    what a machine must actually hold, and is <= the sum of per-role peaks).

    A process found under several roots (one root nested in another's tree) is
    counted once, under the role with the smallest tree, i.e. its nearest root.

    Processes ever seen are remembered (``seen()``) so that a harness can kill
    descendants that were detached or re-parented to init after their parent died.
    """

    def __init__(self, roots: Mapping[str, int], interval_s: float = 0.15) -> None:
        """Prepare (but do not start) sampling of ``roots`` (role name -> root PID)."""
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._roots: dict[str, psutil.Process | None] = {}
        self._peaks: dict[str, int] = {}
        self._peak_total = 0
        self._samples = 0
        self._seen: dict[tuple[int, float], psutil.Process] = {}
        self._hwm: dict[tuple[int, float], tuple[str, int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for name, pid in roots.items():
            self.add(name, pid)

    def add(self, name: str, pid: int) -> None:
        """Track another root, e.g. a process started after sampling began."""
        try:
            proc: psutil.Process | None = psutil.Process(pid)
        except psutil.NoSuchProcess:
            proc = None
        with self._lock:
            self._roots[name] = proc
            self._peaks.setdefault(name, 0)

    def start(self) -> TreeRssSampler:
        """Take one sample now (so short runs still get a figure) and start the thread."""
        if self._thread is not None:
            raise RuntimeError("sampler already started")
        self.sample_once()
        self._thread = threading.Thread(target=self._loop, name="tree-rss-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and take a final sample; safe to call twice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample_once()

    def __enter__(self) -> TreeRssSampler:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.sample_once()

    def sample_once(self) -> dict[str, int]:
        """Take one sample, update the peaks, and return this sample's per-role RSS."""
        with self._lock:
            roots = dict(self._roots)
        trees: dict[str, list[psutil.Process]] = {
            name: tree_processes(root) if root is not None else [] for name, root in roots.items()
        }
        # Attribute each process to its nearest root: nested trees are smaller.
        owner: dict[int, str] = {}
        procs: dict[int, psutil.Process] = {}
        for name in sorted(trees, key=lambda n: len(trees[n]), reverse=True):
            for proc in trees[name]:
                owner[proc.pid] = name
                procs[proc.pid] = proc
        current = dict.fromkeys(roots, 0)
        for pid, name in owner.items():
            current[name] += _rss(procs[pid])
        total = sum(current.values())
        with self._lock:
            for name, value in current.items():
                if value > self._peaks.get(name, 0):
                    self._peaks[name] = value
            self._peak_total = max(self._peak_total, total)
            self._samples += 1
            for pid, proc in procs.items():
                try:
                    key = (pid, proc.create_time())
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                self._seen.setdefault(key, proc)
                hwm = _vm_hwm(pid)
                if hwm is not None:
                    self._hwm[key] = (owner[pid], max(hwm, self._hwm.get(key, ("", 0))[1]))
        return current

    def peaks(self) -> dict[str, int]:
        """Peak tree RSS in bytes per role."""
        with self._lock:
            return dict(self._peaks)

    def peak_total(self) -> int:
        """Peak over sampling instants of the RSS summed over all roles, in bytes."""
        with self._lock:
            return self._peak_total

    def hwm_bound(self) -> dict[str, int]:
        """Per role, the sum of each seen process's kernel peak RSS (an upper bound).

        Empty where /proc is unavailable. A process's peak after its last sample
        (just before it exits) is not included.
        """
        with self._lock:
            bound = dict.fromkeys(self._roots, 0) if self._hwm else {}
            for role, hwm in self._hwm.values():
                bound[role] = bound.get(role, 0) + hwm
            return bound

    @property
    def samples(self) -> int:
        """Number of samples taken (to judge whether peaks are meaningful)."""
        with self._lock:
            return self._samples

    def seen(self) -> list[psutil.Process]:
        """Every process observed in any tree so far (psutil guards against PID reuse)."""
        with self._lock:
            return list(self._seen.values())
