"""The malloc settings: applied on glibc, never over the operator's own choice."""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

from fedtrain.runtime import allocator


@pytest.fixture(autouse=True)
def _find_libc_anew():
    """The C library is looked up once per process; each test here fakes its own."""
    allocator._libc.cache_clear()
    yield
    allocator._libc.cache_clear()


class FakeLibc:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

        def mallopt(param: int, value: int) -> int:
            self.calls.append((param, value))
            return 1

        self.mallopt = mallopt


def test_applies_both_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = FakeLibc()
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: libc)
    assert allocator.tune_allocator({}) is True
    assert libc.calls == [
        (allocator.M_MMAP_THRESHOLD, 32 << 20),
        (allocator.M_TRIM_THRESHOLD, 64 << 20),
    ]


@pytest.mark.parametrize(
    "environ",
    [
        {"MALLOC_ARENA_MAX": "2"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
        {"FEDTRAIN_MALLOC": "default"},
    ],
)
def test_the_operators_choice_wins(monkeypatch: pytest.MonkeyPatch, environ: dict) -> None:
    libc = FakeLibc()
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: libc)
    assert allocator.tune_allocator(environ) is False
    assert libc.calls == []


def test_other_c_libraries_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_mallopt(name: str) -> object:
        raise OSError("not here")

    monkeypatch.setattr(allocator.ctypes, "CDLL", no_mallopt)
    assert allocator.tune_allocator({}) is False


@pytest.mark.parametrize("command", ["server", "client"])
def test_the_server_and_site_commands_tune_before_torch_loads(command: str) -> None:
    """Applied after torch's import the settings recover only part of the gain."""
    probe = (
        "import sys, fedtrain.runtime.allocator as a\n"
        "seen = []\n"
        "a.tune_allocator = lambda *x: seen.append('torch' in sys.modules) or False\n"
        "import fedtrain.cli as cli\n"
        "try:\n"
        f"    cli.main([{command!r}, '--config', '/nonexistent/x.toml', '--insecure'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(seen)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[False]"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_real_glibc_accepts_the_settings() -> None:
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).mallopt  # noqa: B018
    except AttributeError:
        pytest.skip("this C library has no mallopt")
    assert allocator.tune_allocator({}) is True


def test_the_c_library_is_looked_up_once_not_at_every_trim(monkeypatch) -> None:
    """`find_library` spawns `ldconfig`: a server trimming its heap every few seconds
    must not spawn a child (a copy of its resident memory, to a process-tree count)
    each time."""
    looked_up: list[str] = []
    find = ctypes.util.find_library

    def counting(name: str) -> str | None:
        looked_up.append(name)
        return find(name)

    monkeypatch.setattr(allocator.ctypes.util, "find_library", counting)
    for _ in range(3):
        allocator.release_free_memory()
    assert looked_up == ["c"]
