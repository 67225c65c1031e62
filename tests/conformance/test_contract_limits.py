"""Conformance: limits hold; neither the sandbox nor its neighbours suffer (CASES K5)."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from sandfleet.sdk import Sandbox
from sandfleet.wire.models import ExecResult
from tests.conformance.conftest import Fleet

pytestmark = pytest.mark.root

MEMORY_MB = 64
#: Captured output is capped per stream (ExecRequest.max_output_bytes' default).
OUTPUT_CAP = 16 * 1024 * 1024


def _mem_available_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def _disk_used_mb(path: Path) -> int:
    out = subprocess.run(["du", "-sxm", str(path)], capture_output=True, text=True).stdout
    return int(out.split()[0])


@pytest.mark.parametrize(
    "script",
    [
        f"dd if=/dev/zero of=/dev/null bs={MEMORY_MB * 5 // 2}M count=1",
        f"head -c {MEMORY_MB * 5 // 2}m /dev/zero | sort > /dev/null",
        f"x=$(head -c {MEMORY_MB * 5 // 2}000000 /dev/zero | tr '\\0' a); echo ${{#x}}",
    ],
    ids=["dd-buffer", "sort", "shell-variable"],
)
def test_memory_over_the_limit_is_oom_and_the_sandbox_survives(fleet: Fleet, script: str) -> None:
    """K5: touching 2.5x the memory limit ends as status `oom`; the next command runs normally."""
    sb = fleet.create(memory_mb=MEMORY_MB)
    for _ in range(2):
        hog = sb.exec(script, timeout_s=60)
        assert hog.status == "oom", hog
        assert hog.exit_code is None and not hog.ok
        assert sb.exec("echo alive").stdout == b"alive\n"
    # half the limit is allowed and not reported as oom
    fits = sb.exec(f"dd if=/dev/zero of=/dev/null bs={MEMORY_MB // 2}M count=1", timeout_s=30)
    assert (fits.status, fits.exit_code) == ("exited", 0), fits


def test_a_fork_bomb_is_contained(fleet: Fleet) -> None:
    """K5: a fork bomb hits the process limit; the sandbox, a neighbour and destroy keep working."""
    bombed = fleet.create(pids_limit=64)
    neighbour = fleet.create()
    result: dict[str, ExecResult] = {}

    def bomb() -> None:
        result["r"] = bombed.exec("b() { b | b & }; b; sleep 30", timeout_s=10)

    thread = threading.Thread(target=bomb)
    t0 = time.monotonic()
    thread.start()
    time.sleep(2)
    for _ in range(5):
        t1 = time.monotonic()
        assert neighbour.exec("echo fine").stdout == b"fine\n"
        assert time.monotonic() - t1 < 2
        time.sleep(0.3)
    thread.join(30)
    assert not thread.is_alive()
    r = result["r"]
    assert r.status == "timeout", r
    assert time.monotonic() - t0 < 14
    assert b"fork" in r.stderr or b"Resource temporarily unavailable" in r.stderr
    ps = bombed.exec(["ps", "-o", "pid"])
    assert ps.ok and len(ps.stdout.splitlines()) < 10, ps.stdout_text
    assert bombed.exec("echo recovered").stdout == b"recovered\n"
    t1 = time.monotonic()
    bombed.destroy()
    assert time.monotonic() - t1 < 10
    assert neighbour.exec("echo fine").stdout == b"fine\n"


def test_the_process_limit_is_enforced(fleet: Fleet) -> None:
    """K5: with pids_limit=16, forks past the limit fail and no more than 16 processes exist."""
    sb = fleet.create(pids_limit=16)
    r = sb.exec("i=0; while [ $i -lt 40 ]; do sleep 3 & i=$((i+1)); done", timeout_s=20)
    assert r.status == "exited" and r.exit_code != 0, r
    assert b"fork" in r.stderr or b"Resource temporarily unavailable" in r.stderr
    pids = [e.name for e in sb.files.list("/proc") if e.name.isdigit()]
    assert 8 <= len(pids) <= 16, pids
    time.sleep(3.5)
    assert sb.exec("echo again").stdout == b"again\n"


def test_unbounded_output_is_capped_and_the_node_is_not_filled(
    fleet: Fleet, sandbox: Sandbox
) -> None:
    """K5: `yes` without bound: output capped (head and tail kept, drop counted), node unharmed."""
    mem0 = _mem_available_mb()
    disk0 = _disk_used_mb(fleet.deployment.state_dir)
    r = sandbox.exec("yes", timeout_s=3)
    assert r.status == "timeout"
    assert 0 < len(r.stdout) <= OUTPUT_CAP and r.stdout_dropped > 0
    assert r.stdout.startswith(b"y\ny\n") and r.stdout.endswith(b"y\n")
    r = sandbox.exec("yes >&2", timeout_s=3)
    assert r.status == "timeout"
    assert 0 < len(r.stderr) <= OUTPUT_CAP and r.stderr_dropped > 0 and r.stdout == b""
    assert _mem_available_mb() > mem0 - 1024
    assert _disk_used_mb(fleet.deployment.state_dir) < disk0 + 64
    assert shutil.disk_usage(fleet.deployment.state_dir).free > 1 << 30
    assert sandbox.exec("echo after").stdout == b"after\n"


@pytest.mark.parametrize("redirect", ["", " >&2"], ids=["stdout", "stderr"])
def test_capped_output_keeps_head_and_tail(sandbox: Sandbox, redirect: str) -> None:
    """K5: past the cap the middle is dropped: the first and last bytes stay, drops are counted."""
    total = 40_000_000
    r = sandbox.exec(f"(echo START; yes | head -c {total}; echo END){redirect}", timeout_s=60)
    assert r.ok, r
    out, dropped = (r.stderr, r.stderr_dropped) if redirect else (r.stdout, r.stdout_dropped)
    assert out.startswith(b"START\ny\n") and out.endswith(b"y\nEND\n")
    assert len(out) <= OUTPUT_CAP
    assert len(out) + dropped == len(b"START\n") + total + len(b"END\n")


def test_a_memory_hog_does_not_slow_a_neighbour(fleet: Fleet) -> None:
    """K5: while one sandbox keeps hitting its memory limit, a command elsewhere is prompt."""
    hog = fleet.create(memory_mb=MEMORY_MB)
    calm = fleet.create()
    done: dict[str, ExecResult] = {}

    def run_hog() -> None:
        done["r"] = hog.exec(
            f"while true; do dd if=/dev/zero of=/dev/null bs={MEMORY_MB * 3}M count=1; done",
            timeout_s=6,
        )

    thread = threading.Thread(target=run_hog)
    thread.start()
    time.sleep(1)
    slowest = 0.0
    for i in range(10):
        t0 = time.monotonic()
        r = calm.exec(f"echo {i}")
        slowest = max(slowest, time.monotonic() - t0)
        assert (r.status, r.stdout) == ("exited", f"{i}\n".encode())
        time.sleep(0.2)
    thread.join(30)
    assert slowest < 1.0, slowest
    assert done["r"].status in ("timeout", "oom"), done["r"]
    assert hog.exec("echo alive").stdout == b"alive\n"
