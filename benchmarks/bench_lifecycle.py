"""Pause and resume: latency for one sandbox and for a group of 100, and what paused boxes cost.

Starts ``sandfleet up`` (LocalDeployment) in a fresh state directory under
/var/tmp with a busybox image built there as tests/conftest.py builds it
(needs ``busybox-static``), prints a rich table, destroys everything (also on
an error) and ends with ``sandfleet.node.leaks.leftovers(state_dir)``.
Run as root: ``python benchmarks/bench_lifecycle.py [--group N] [--rounds N]``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sandfleet.cli.local import LocalDeployment
from sandfleet.images import ImageStore, build_busybox
from sandfleet.node.leaks import leftovers
from sandfleet.sdk import Client, Sandbox

IMAGE = "bench/busybox:1"


def ms(samples: list[float]) -> str:
    """p50 / p99 of ``samples`` (seconds) in milliseconds."""
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return f"{statistics.median(ordered) * 1e3:.1f} / {p99 * 1e3:.1f} ms"


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def used_mib() -> float:
    """MemTotal - MemAvailable, MiB: median of 5 samples 0.3 s apart after dropping caches."""
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3")
    time.sleep(1.0)
    samples = []
    for _ in range(5):
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info[key] = int(value.split()[0])
        samples.append((info["MemTotal"] - info["MemAvailable"]) / 1024)
        time.sleep(0.3)
    return statistics.median(samples)


def charged_mib(sandboxes: list[Sandbox]) -> float:
    """Σ memory charged to the boxes' memory cgroups, MiB (v1 usage_in_bytes, v2 current)."""
    total = 0
    for sb in sandboxes:
        v1 = Path("/sys/fs/cgroup/memory/sandfleet", sb.id, "memory.usage_in_bytes")
        v2 = Path("/sys/fs/cgroup/sandfleet", sb.id, "memory.current")
        total += int((v1 if v1.exists() else v2).read_text())
    return total / 2**20


def cpu_s(sandboxes: list[Sandbox]) -> float:
    """CPU seconds the boxes' cgroups used so far (v1 cpuacct or v2 cpu.stat)."""
    total = 0.0
    for sb in sandboxes:
        v1 = Path("/sys/fs/cgroup/cpuacct/sandfleet", sb.id, "cpuacct.usage")
        if v1.exists():
            total += int(v1.read_text()) / 1e9
            continue
        stat = Path("/sys/fs/cgroup/sandfleet", sb.id, "cpu.stat").read_text().split()
        total += int(stat[stat.index("usage_usec") + 1]) / 1e6
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--group", type=int, default=100, help="sandboxes in the group")
    parser.add_argument("--rounds", type=int, default=30, help="pause/resume rounds of one")
    args = parser.parse_args()
    console = Console()
    state = Path(tempfile.mkdtemp(prefix="bench-lifecycle-", dir="/var/tmp"))
    build_busybox(ImageStore(state / "images"), IMAGE, log=lambda _: None)
    table = Table("what", "value", "method", title="sandfleet pause / resume")
    with LocalDeployment(state / "state", state / "images") as dep, Client(dep.url) as client:
        try:
            one = client.create(image=IMAGE, memory_mb=64)
            for _ in range(3):  # warm-up
                one.pause()
                one.resume()
            pause, resume, implicit, running_exec = [], [], [], []
            for _ in range(args.rounds):
                pause.append(timed(one.pause))  # from running
                resume.append(timed(one.resume))  # from paused
                running_exec.append(timed(lambda: one.exec(["true"])))
                one.pause()
                implicit.append(timed(lambda: one.exec(["true"])))  # resumes first
            one.destroy()
            n = args.rounds
            table.add_row("pause, 1 sandbox, p50 / p99", ms(pause), f"{n} x sb.pause() (sync SDK)")
            table.add_row("resume, 1 sandbox, p50 / p99", ms(resume), f"{n} x sb.resume()")
            table.add_row(
                "exec `true` on a paused sandbox (implicit resume), p50 / p99",
                ms(implicit),
                f"{n} x sb.exec(['true']) right after sb.pause()",
            )
            table.add_row("exec `true` on a running sandbox, p50 / p99", ms(running_exec), "same")

            console.print(f"creating {args.group} idle sandboxes ...")
            before = used_mib()
            group = [
                client.create(image=IMAGE, memory_mb=64, labels={"job": "bench"})
                for _ in range(args.group)
            ]
            running = used_mib()
            charged_running = charged_mib(group)
            cpu0 = cpu_s(group)
            time.sleep(2.0)
            cpu_running = cpu_s(group) - cpu0
            label = {"job": "bench"}
            pauses, resumes = [], []
            for _ in range(5):
                t0 = time.perf_counter()
                done = client.pause(labels=label)
                pauses.append(time.perf_counter() - t0)
                assert len(done.sandboxes) == args.group and not done.failed, done.failed
                t0 = time.perf_counter()
                done = client.resume(labels=label)
                resumes.append(time.perf_counter() - t0)
                assert len(done.sandboxes) == args.group and not done.failed, done.failed
            client.pause(labels=label)
            paused = used_mib()
            charged_paused = charged_mib(group)
            cpu0 = cpu_s(group)
            time.sleep(2.0)
            cpu_paused = cpu_s(group) - cpu0
            g = args.group
            table.add_row(
                f"pause, group of {g}, p50 / max",
                f"{statistics.median(pauses) * 1e3:.0f} / {max(pauses) * 1e3:.0f} ms",
                "5 x client.pause(labels={'job': 'bench'}): one call, the control plane"
                " pauses them in parallel",
            )
            table.add_row(
                f"resume, group of {g}, p50 / max",
                f"{statistics.median(resumes) * 1e3:.0f} / {max(resumes) * 1e3:.0f} ms",
                "5 x client.resume(labels=...)",
            )
            table.add_row(
                f"memory charged to {g} running idle / paused boxes",
                f"{charged_running:.1f} / {charged_paused:.1f} MiB"
                f" ({charged_running / g:.2f} / {charged_paused / g:.2f} MiB each)",
                "Σ memory.usage_in_bytes (v1) or memory.current (v2) of their cgroups,"
                " running (idle agent) then after client.pause(labels=...)",
            )
            table.add_row(
                f"host memory, {g} running idle / paused",
                f"{running - before:.1f} / {paused - before:.1f} MiB"
                f" ({(running - before) / g:.2f} / {(paused - before) / g:.2f} MiB each)",
                "Δ(MemTotal - MemAvailable) against before creating them; median of 5"
                " samples after sync + drop_caches (host-wide: other work on the host shows)",
            )
            table.add_row(
                f"CPU used by {g} boxes in 2 s, running idle / paused",
                f"{cpu_running * 1e3:.1f} / {cpu_paused * 1e3:.1f} ms",
                "Σ cpuacct.usage (v1) or cpu.stat usage_usec (v2) of their cgroups",
            )
            for sb in group:
                sb.destroy()
        finally:
            for info in client.list():
                client.get(info.id).destroy()
    console.print(table)
    left = leftovers(state / "state")
    console.print(f"leftovers: {left or 'none'}")
    shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
