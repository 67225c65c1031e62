"""FnCall warm pools, measured end to end through the SDK against a running server.

Starts ``sandfleet up`` (LocalDeployment) in a fresh state directory under /var/tmp
unless ``--url`` points at a running control plane, and uses the fncall image
``sandfleet/fncall:1`` (built by ``ensure_fncall_image`` if missing). Every figure is
wall-clock time from ``time.perf_counter`` or a /proc or cgroup counter; nothing is
asserted. What is measured, and how:

1. ``AsyncClient.run("print(1)", kind="fncall", language="python")`` at concurrency
   1, 8 and 64 (``--levels``): after ``configure_pool(min_workers=W, max_workers=W)``
   (W = ``--workers``, default 2 x cores) and waiting until all W are idle, a warm-up,
   then N calls per level, three ways: "SDK", a closed loop of c asyncio tasks sharing
   one AsyncClient, each making one call at a time (the SDK coalesces the calls made in
   the same event-loop turn into one ``POST /v1/run/batch``); "SDK, rounds", rounds of c
   calls started together with ``asyncio.gather`` (one batch per round, as a rollout's
   reward checks would be), latency counted from the round's start; "HTTP", the closed
   loop with httpx and one ``POST /v1/run`` per call. calls/s = N / wall; p50 / p99 /
   mean of each call's latency; the worker's own ``duration_s`` (fork to exit, in the
   box); the machine's busy CPU per call and the CPU of processes that are not this
   benchmark's (a check that nothing else ran). A call counts as failed unless it exited 0
   with stdout ``1\n``. The pool state (``client.pools()``) is printed after.
2. The naive baseline, same run, same limits: a container sandbox of the same image
   (``memory_mb=256, cpu=1, pids_limit=64``) and per call
   ``sandbox.exec(["python3", "-c", "print(1)"])``, a fresh interpreter per call. At
   concurrency c the calls go round-robin over min(c, 8) sandboxes (created before and
   destroyed after, outside the figures). Ratios fncall / baseline of calls/s and p50.
3. SandboxFusion's own server: only its client (``sandbox-fusion``) is on PyPI, no server
   package, so nothing is run unless ``--fusion-url`` names a running SandboxFusion server
   (then ``POST /run_code`` with the same code at the same levels). Also, if this
   sandfleet serves the SandboxFusion-compatible ``POST /run_code``, the same calls
   through it with httpx, as an RL framework would send them.
4. CPU per call: ``--cpu-calls`` SDK calls at the highest level, as a closed loop and in
   rounds (as in part 1); CPU seconds of the control
   plane and node agent processes (``/proc/<pid>/stat`` utime + stime), of the workers
   (``cpuacct.usage`` of their ``fw-*`` cgroups, which counts every per-call fork; split
   into the zygotes' own utime + stime and the rest, the calls' processes), of this client
   (``time.process_time``) and of the whole machine (``/proc/stat``), after - before,
   divided by the calls; and the minor page faults of the zygotes and of their reaped
   children (``minflt`` / ``cminflt``) per call.
5. Memory per idle worker, last: the pool reconfigured to ``--idle-workers`` idle workers;
   ``worker_memory_mb`` from ``client.pools()``, and from the host the RSS and PSS
   (``/proc/<pid>/smaps_rollup``) of the processes in the workers' ``fw-*`` memory cgroups
   and the cgroups' ``memory.usage_in_bytes`` (v1) / ``memory.current`` (v2), per worker;
   and the host's (MemTotal - MemAvailable) growth from W to ``--idle-workers`` workers,
   medians of 5 samples (after ``sync; echo 3 > drop_caches`` unless
   ``--no-drop-caches``), divided by the added workers.

Run as root: ``python benchmarks/bench_fncall.py [--images-dir DIR] [--quick]``.
Everything created is destroyed, also on Ctrl-C or an error; a local deployment is
stopped and ``sandfleet.node.leaks.leftovers(state_dir)`` checked. Writes nothing but
stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from sandfleet.cli.local import LocalDeployment
from sandfleet.fncall.images import ensure_fncall_image
from sandfleet.node.leaks import leftovers
from sandfleet.node.mounts import mounts_under
from sandfleet.sdk import AsyncClient, AsyncSandbox
from sandfleet.wire.models import FNCALL_IMAGE, PoolInfo, RunRequest, RunResult

CODE = "print(1)"
JSON = {"content-type": "application/json"}
EXPECTED = b"1\n"
BASELINE_CMD = ["python3", "-c", CODE]
BASELINE_LIMITS: dict[str, Any] = {"memory_mb": 256, "cpu": 1.0, "pids_limit": 64}
BASELINE_BOXES = 8  # at most this many sandboxes, round-robin
GOAL_RATE = 1000.0  # calls/s
GOAL_P50 = 0.003  # s
FUSION_PRIOR = (
    "prior measurement on this machine (DESIGN.md, not from this run): SandboxFusion's "
    "server answered `print(1)` at ≈ 41 ms p50 and ≈ 46 calls/s without isolation, "
    "≈ 340 ms and ≈ 4.5 calls/s with its overlay isolation"
)
FUSION_PYPI = (
    "not installable from PyPI: only the client `sandbox-fusion` (0.3.7) is published; "
    "`pip download sandbox-fusion-server` and `pip download sandboxfusion` find no "
    "distribution, and the server's source (GitHub) is not reachable from this machine"
)


@dataclass(frozen=True)
class Counts:
    calls: int  # fncall calls per concurrency level
    warmup: int  # fncall warm-up calls (at the highest level)
    baseline_calls: int  # baseline execs per level
    baseline_warmup: int  # baseline warm-up execs per sandbox
    cpu_calls: int  # calls for the CPU breakdown


FULL = Counts(calls=2000, warmup=200, baseline_calls=200, baseline_warmup=2, cpu_calls=2000)
QUICK = Counts(calls=200, warmup=40, baseline_calls=40, baseline_warmup=1, cpu_calls=300)


@dataclass
class Level:
    """The calls of one concurrency level: latencies of the good ones, failures, wall."""

    concurrency: int
    latencies: list[float] = field(default_factory=list)
    inner: list[float] = field(default_factory=list)  # duration_s the server reports
    wrong: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    wall: float = 0.0

    @property
    def n(self) -> int:
        return len(self.latencies) + self.wrong + sum(self.errors.values())

    @property
    def rate(self) -> float:
        return self.n / self.wall if self.wall else 0.0

    def p(self, q: float) -> float:
        return pct(self.latencies, q) if self.latencies else math.nan

    def failures(self) -> str:
        parts = [f"{self.wrong} wrong output"] if self.wrong else []
        parts += [f"{k} x{v}" for k, v in sorted(self.errors.items())]
        return ", ".join(parts) or "0"


# ---------------------------------------------------------------------- helpers


def pct(samples: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100) of ``samples``."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ms(seconds: float) -> str:
    return "—" if math.isnan(seconds) else f"{seconds * 1000:.2f} ms"


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def meminfo() -> dict[str, int]:
    """/proc/meminfo in KiB."""
    out: dict[str, int] = {}
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0])
    return out


def memory_in_use(drop_caches: bool, samples: int = 5, gap_s: float = 0.5) -> float:
    """Median over ``samples`` of MemTotal - MemAvailable, KiB."""
    if drop_caches:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as fh:
            fh.write("3\n")
    time.sleep(2.0)
    values = []
    for _ in range(samples):
        m = meminfo()
        values.append(m["MemTotal"] - m["MemAvailable"])
        time.sleep(gap_s)
    return statistics.median(values)


def proc_kib(pid: int, path: str, key: str) -> int:
    """``key:`` of /proc/<pid>/<path> in KiB; 0 if the process is gone."""
    try:
        with open(f"/proc/{pid}/{path}", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def proc_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), seconds; 0 if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rpartition(")")[2].split()
    # fields[0] is the state (field 3); utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (all cores; idle and iowait excluded)."""
    with open("/proc/stat", encoding="ascii") as fh:
        cols = [int(x) for x in fh.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = cols[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def cgroup_base(controller: str) -> Path | None:
    """The ``sandfleet`` cgroup parent of ``controller``: v1 hierarchy, else the v2 root."""
    for d in (Path("/sys/fs/cgroup", controller, "sandfleet"), Path("/sys/fs/cgroup/sandfleet")):
        if (d / "cgroup.procs").exists():
            return d
    return None


def worker_cgroups(controller: str, node_id: str | None) -> list[Path]:
    """The ``fw-*`` cgroups of fncall workers (of ``node_id`` when known)."""
    base = cgroup_base(controller)
    if base is None:
        return []
    suffix = f"-{node_id}" if node_id else ""
    return sorted(d for d in base.glob("fw-*") if d.is_dir() and d.name.endswith(suffix))


def worker_cpu_s(node_id: str | None) -> dict[str, float]:
    """CPU seconds of each worker cgroup: v1 ``cpuacct.usage`` or v2 ``cpu.stat`` usage_usec."""
    out: dict[str, float] = {}
    for d in worker_cgroups("cpuacct", node_id):
        with contextlib.suppress(OSError, ValueError):
            if (d / "cpuacct.usage").exists():
                out[d.name] = int((d / "cpuacct.usage").read_text()) / 1e9
                continue
            for line in (d / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    out[d.name] = int(line.split()[1]) / 1e6
    return out


def cgroup_pids(d: Path) -> list[int]:
    with contextlib.suppress(OSError, ValueError):
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]
    return []


def cgroup_charge(d: Path) -> int:
    """Bytes charged to a memory cgroup (v1 usage_in_bytes or v2 memory.current)."""
    for name in ("memory.usage_in_bytes", "memory.current"):
        with contextlib.suppress(OSError, ValueError):
            return int((d / name).read_text())
    return 0


def deployment_pids(state: Path) -> dict[str, int]:
    """The processes of the local deployment using ``state``: control plane and node agent."""
    needle = f"--state-dir\0{state}\0".encode()
    out: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes()
            if needle not in cmdline:
                continue
            if b"\0up\0" in cmdline:
                out["control plane (`sandfleet up`)"] = int(entry.name)
            elif b"\0node\0" in cmdline:
                out["node agent"] = int(entry.name)
    return out


def proc_stat(pid: int) -> list[int]:
    """/proc/<pid>/stat from field 4 (ppid) on, as integers; [] if the process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1:]
        return [int(x) for x in fields[:20]]
    except (OSError, ValueError):
        return []


# indexes into proc_stat()
PPID, MINFLT, CMINFLT = 0, 6, 7


@dataclass
class CpuSnap:
    """CPU seconds consumed so far, by where they were spent."""

    procs: dict[str, float]  # control plane, node agent (utime + stime, all threads)
    workers: dict[str, float]  # cpuacct of each fw-* cgroup (zygote + every fork)
    zygotes: float  # own utime + stime of the workers' long-lived PID 1s
    faults: tuple[int, int]  # minor page faults of the zygotes and of their reaped children
    client: float  # this process
    machine: float  # /proc/stat busy, all cores

    @staticmethod
    def take(procs: dict[str, int], node_id: str | None) -> CpuSnap:
        zygotes = 0.0
        own = children = 0
        for d in worker_cgroups("cpuacct", node_id):
            pids = cgroup_pids(d)
            inside = set(pids)
            for p in pids:
                st = proc_stat(p)
                # PID 1 of the box: the one process whose parent is outside the cgroup
                if st and st[PPID] not in inside:
                    zygotes += proc_cpu_s(p)
                    own += st[MINFLT]
                    children += st[CMINFLT]
        return CpuSnap(
            procs={k: proc_cpu_s(pid) for k, pid in procs.items()},
            workers=worker_cpu_s(node_id),
            zygotes=zygotes,
            faults=(own, children),
            client=time.process_time(),
            machine=machine_busy_s(),
        )

    def since(self, before: CpuSnap) -> dict[str, float]:
        """Seconds spent between ``before`` and this snapshot, by part."""
        out = {k: v - before.procs.get(k, v) for k, v in self.procs.items()}
        common = set(self.workers) & set(before.workers)
        workers = sum(self.workers[k] - before.workers[k] for k in common)
        zyg = self.zygotes - before.zygotes
        # Workers present at both ends (one may be recycled after 10,000 calls).
        out["workers, fw-* cgroups (cpuacct), all"] = workers
        out["  of which the zygotes (PID 1: fork, wait, scrub, framing)"] = zyg
        out["  of which the calls' forks (the code, exec'd tools, exit)"] = workers - zyg
        out["this client (AsyncClient, asyncio, one process)"] = self.client - before.client
        known = sum(v for k, v in out.items() if not k.startswith("  "))
        out["everything else (kernel threads, runc, other processes)"] = (
            self.machine - before.machine - known
        )
        out["whole machine (/proc/stat busy)"] = self.machine - before.machine
        return out


def pool_of(pools: list[PoolInfo]) -> list[PoolInfo]:
    return [p for p in pools if p.image == FNCALL_IMAGE and p.language == "python"]


def pool_row(p: PoolInfo) -> tuple[str, ...]:
    rss = "—" if p.worker_memory_mb is None else f"{p.worker_memory_mb:.1f}"
    return (
        p.node_id,
        f"{p.min_workers}..{p.max_workers}",
        str(p.idle),
        str(p.busy),
        str(p.starting),
        str(p.queued),
        str(p.calls),
        str(p.replaced),
        str(p.rejected),
        rss,
        (p.last_error or "")[:60],
    )


POOL_COLUMNS = (
    "node",
    "min..max",
    "idle",
    "busy",
    "starting",
    "queued",
    "calls",
    "replaced",
    "rejected",
    "worker MiB (cgroup)",
    "last error",
)


#: One call: its stdout (None when it did not exit 0) and the duration the server reports.
Call = Callable[[int], Awaitable[tuple[bytes | None, float | None]]]


async def _timed(level: Level, call: Call, i: int, t0: float) -> None:
    try:
        out, inner = await call(i)
    except Exception as exc:
        key = f"{type(exc).__name__}: {str(exc)[:80]}"
        level.errors[key] = level.errors.get(key, 0) + 1
        if sum(level.errors.values()) > 50:
            raise
        return
    elapsed = time.perf_counter() - t0
    if out == EXPECTED:
        level.latencies.append(elapsed)
        if inner is not None:
            level.inner.append(inner)
    else:
        level.wrong += 1


async def run_level(concurrency: int, n: int, call: Call) -> Level:
    """``n`` calls of ``call(i)``, closed loop: ``concurrency`` tasks, each one call at a time."""
    level = Level(concurrency)
    it = iter(range(n))

    async def worker() -> None:
        for i in it:
            await _timed(level, call, i, time.perf_counter())

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(worker())
    level.wall = time.perf_counter() - t0
    return level


async def run_rounds(concurrency: int, n: int, call: Call) -> Level:
    """``n`` calls in rounds of ``concurrency`` started together (``asyncio.gather``);
    the next round starts when the whole round is done. Latency from the round's start."""
    level = Level(concurrency)
    t0 = time.perf_counter()
    for start in range(0, n, concurrency):
        r0 = time.perf_counter()
        count = min(concurrency, n - start)
        await asyncio.gather(*(_timed(level, call, start + j, r0) for j in range(count)))
    level.wall = time.perf_counter() - t0
    return level


# ---------------------------------------------------------------------- the benchmark


class Bench:
    """One run: the deployment (ours or ``--url``), the sandboxes made, the figures."""

    def __init__(self, args: argparse.Namespace, state: Path | None) -> None:
        self.args = args
        counts: Counts = QUICK if args.quick else FULL
        given = {
            name: getattr(args, name)
            for name in ("calls", "baseline_calls", "cpu_calls")
            if getattr(args, name)
        }
        self.counts = dataclasses.replace(counts, **given)
        self.levels: list[int] = args.levels
        self.workers: int = args.workers
        self.min_workers: int = args.min_workers if args.min_workers is not None else args.workers
        console = Console()
        self.console = console if console.is_terminal else Console(width=170)
        self.state = state
        self.dep = LocalDeployment(state, args.images_dir) if state is not None else None
        self.url: str = args.url or (self.dep.url if self.dep else "")
        self.node_id: str | None = self.dep.node_id if self.dep else None
        self.procs: dict[str, int] = {}  # of the local deployment, once started
        self.boxes: list[AsyncSandbox] = []
        self.fn: dict[int, Level] = {}
        self.plain: dict[int, Level] = {}
        self.rounds: dict[int, Level] = {}
        self.base: dict[int, Level] = {}
        self.summary: list[str] = []

    def table(self, title: str, *columns: str) -> Table:
        return Table(*columns, title=title, title_justify="left")

    def snap(self) -> CpuSnap:
        return CpuSnap.take(self.procs, self.node_id)

    # ------------------------------------------------------------------ pool

    async def configure(self, client: AsyncClient, min_workers: int, max_workers: int) -> None:
        await client.configure_pool(
            image=FNCALL_IMAGE,
            language="python",
            min_workers=min_workers,
            max_workers=max_workers,
        )

    async def wait_idle(self, client: AsyncClient, want: int, timeout_s: float = 180.0) -> float:
        """Wait until the pool has ``want`` idle workers (summed over nodes); seconds waited."""
        t0 = time.perf_counter()
        while True:
            pools = pool_of(await client.pools())
            idle = sum(p.idle for p in pools)
            busy = sum(p.busy + p.starting + p.queued for p in pools)
            if idle >= want and busy == 0:
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout_s:
                errors = "; ".join(p.last_error for p in pools if p.last_error)
                raise TimeoutError(
                    f"pool has {idle} idle workers of {want} after {timeout_s:.0f} s"
                    + (f" (last error: {errors})" if errors else "")
                )
            await asyncio.sleep(0.2)

    async def print_pools(self, client: AsyncClient, title: str) -> list[PoolInfo]:
        pools = pool_of(await client.pools())
        t = self.table(title, *POOL_COLUMNS)
        for p in pools:
            t.add_row(*pool_row(p))
        self.console.print(t)
        return pools

    # ------------------------------------------------------------------ 1. fncall

    def fncall_call(self, client: AsyncClient) -> Call:
        async def call(_: int) -> tuple[bytes | None, float | None]:
            r = await client.run(CODE, kind="fncall", language="python")
            return (r.stdout if r.ok else None), r.duration_s

        return call

    async def part_fncall(self, client: AsyncClient) -> None:
        waited = await self.wait_idle(client, self.min_workers)
        self.console.print(
            f"pool {FNCALL_IMAGE} python: min_workers={self.min_workers} "
            f"max_workers={self.workers}, {self.min_workers} idle after {waited:.1f} s"
        )
        call = self.fncall_call(client)
        warm = await run_level(max(self.levels), self.counts.warmup, call)
        t = self.table(
            f"1. fncall `{CODE}`, {self.counts.calls} calls per level after "
            f"{self.counts.warmup} warm-up ({warm.rate:.0f} calls/s), pool of "
            f"{self.min_workers}..{self.workers} workers. SDK: AsyncClient.run (calls made "
            "in the same event-loop turn go as one POST /v1/run/batch); HTTP: httpx, one "
            "POST /v1/run per call",
            "path",
            "concurrency",
            "calls",
            "calls/s",
            "p50",
            "p99",
            "mean",
            "max",
            "worker duration_s p50",
            "wall",
            "failed",
            "machine CPU per call",
            "others' CPU",
        )
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(base_url=self.url, timeout=60.0, limits=limits) as h:

            async def plain(_: int) -> tuple[bytes | None, float | None]:
                r = await h.post("/v1/run", content=body, headers=JSON)
                r.raise_for_status()
                res = RunResult.model_validate_json(r.content)
                return (res.stdout if res.ok else None), res.duration_s

            body = RunRequest(code=CODE, language="python").model_dump_json().encode()
            await run_level(max(self.levels), self.counts.warmup, plain)
            paths: list[tuple[str, Call, dict[int, Level], Callable[..., Awaitable[Level]]]] = [
                ("SDK", call, self.fn, run_level),
                ("SDK, rounds", call, self.rounds, run_rounds),
                ("HTTP", plain, self.plain, run_level),
            ]
            for path, fn, into, runner in paths:
                for c in self.levels:
                    before = self.snap()
                    level = await runner(c, self.counts.calls, fn)
                    spent = self.snap().since(before)
                    into[c] = level
                    xs = level.latencies
                    t.add_row(
                        path,
                        str(c),
                        str(level.n),
                        f"{level.rate:.0f}",
                        ms(level.p(50)),
                        ms(level.p(99)),
                        ms(statistics.fmean(xs)) if xs else "—",
                        ms(max(xs)) if xs else "—",
                        ms(pct(level.inner, 50)) if level.inner else "—",
                        f"{level.wall:.2f} s",
                        level.failures(),
                        f"{spent['whole machine (/proc/stat busy)'] * 1000 / level.n:.2f} ms",
                        f"{spent['everything else (kernel threads, runc, other processes)']:.2f} s"
                        if self.procs
                        else "n/a (--url)",
                    )
        self.console.print(t)
        await self.print_pools(client, "1b. pool state after part 1 (client.pools())")

    # ------------------------------------------------------------------ 2. baseline

    async def part_baseline(self, client: AsyncClient) -> None:
        k = min(max(self.levels), BASELINE_BOXES)
        for _ in range(k):
            self.boxes.append(await client.create(image=FNCALL_IMAGE, **BASELINE_LIMITS))
        for sb in self.boxes:
            for _ in range(self.counts.baseline_warmup):
                await sb.exec(BASELINE_CMD)
        t = self.table(
            f"2. baseline: container sandbox ({FNCALL_IMAGE}, memory_mb=256, cpu=1, "
            f"pids_limit=64), per call exec `python3 -c {CODE!r}` (a fresh interpreter); "
            f"{self.counts.baseline_calls} calls per level, round-robin over min(c, "
            f"{BASELINE_BOXES}) sandboxes",
            "concurrency",
            "sandboxes",
            "calls",
            "calls/s",
            "p50",
            "p99",
            "in-box duration_s p50",
            "failed",
            "fncall / baseline calls/s",
            "fncall / baseline p50",
        )
        for c in self.levels:
            boxes = self.boxes[: min(c, BASELINE_BOXES)]

            async def call(
                i: int, boxes: list[AsyncSandbox] = boxes
            ) -> tuple[bytes | None, float | None]:
                r = await boxes[i % len(boxes)].exec(BASELINE_CMD)
                return (r.stdout if r.ok else None), r.duration_s

            level = await run_level(c, self.counts.baseline_calls, call)
            self.base[c] = level
            fn = self.fn.get(c)
            rate_ratio = f"{fn.rate / level.rate:.1f}x" if fn and level.rate else "—"
            p50_ratio = (
                f"{fn.p(50) / level.p(50):.3f}x" if fn and fn.latencies and level.latencies else "—"
            )
            t.add_row(
                str(c),
                str(len(boxes)),
                str(level.n),
                f"{level.rate:.1f}",
                ms(level.p(50)),
                ms(level.p(99)),
                ms(pct(level.inner, 50)) if level.inner else "—",
                level.failures(),
                rate_ratio,
                p50_ratio,
            )
        self.console.print(t)
        await self.destroy_boxes()

    async def destroy_boxes(self) -> None:
        boxes, self.boxes = self.boxes, []
        results = await asyncio.gather(*(sb.destroy() for sb in boxes), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            self.console.print(f"[red]{len(failed)} baseline sandboxes not destroyed: {failed[0]}")

    # ------------------------------------------------------------------ 3. SandboxFusion

    async def fusion_levels(self, url: str) -> dict[int, Level]:
        """The same calls as SandboxFusion's wire format: ``POST {url}/run_code``."""
        body = {"code": CODE, "language": "python"}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits) as h:

            async def call(_: int) -> tuple[bytes | None, float | None]:
                r = await h.post("/run_code", json=body)
                r.raise_for_status()
                answer = r.json()
                run = answer.get("run_result") or {}
                ok = answer.get("status") == "Success" and run.get("return_code") == 0
                out = str(run.get("stdout", "")).encode() if ok else None
                return out, run.get("execution_time")

            await run_level(max(self.levels), min(self.counts.warmup, 50), call)
            n = self.counts.calls if url == self.url else self.counts.baseline_calls
            return {c: await run_level(c, n, call) for c in self.levels}

    async def sandfleet_run_code(self) -> bool:
        """Whether this sandfleet serves ``POST /run_code`` (answers it with JSON, not 404)."""
        try:
            async with httpx.AsyncClient(base_url=self.url, timeout=30.0) as h:
                r = await h.post("/run_code", json={"code": CODE, "language": "python"})
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    async def part_fusion(self) -> None:
        t = self.table(
            f"3. SandboxFusion on the same `{CODE}` calls",
            "server",
            "concurrency",
            "calls",
            "calls/s",
            "p50",
            "p99",
            "failed",
            "fncall / this calls/s",
            "fncall / this p50",
        )
        rows: list[tuple[str, dict[int, Level]]] = []
        if self.args.fusion_url:
            name = f"SandboxFusion server at {self.args.fusion_url}"
            rows.append((name, await self.fusion_levels(self.args.fusion_url)))
        else:
            blank = ("",) * 7
            t.add_row("SandboxFusion's own server", "—", *blank)
            t.add_row(f"  {FUSION_PYPI}", "", *blank)
            top, first = self.fn.get(self.levels[-1]), self.fn.get(self.levels[0])
            t.add_row(
                "SandboxFusion, prior measurement (DESIGN.md), NOT this run",
                "?",
                "—",
                "≈ 46",
                "≈ 41 ms",
                "—",
                "—",
                f"{top.rate / 46:.0f}x (c={top.concurrency})" if top else "—",
                f"{first.p(50) / 0.041:.3f}x (c={first.concurrency})" if first else "—",
            )
        if await self.sandfleet_run_code():
            name = "sandfleet's own POST /run_code (SandboxFusion format, httpx)"
            rows.append((name, await self.fusion_levels(self.url)))
        else:
            t.add_row("sandfleet POST /run_code", "not served", *("",) * 7)
        for name, levels in rows:
            for c, level in levels.items():
                fn = self.fn.get(c)
                t.add_row(
                    name,
                    str(c),
                    str(level.n),
                    f"{level.rate:.1f}",
                    ms(level.p(50)),
                    ms(level.p(99)),
                    level.failures(),
                    f"{fn.rate / level.rate:.2f}x" if fn and level.rate else "—",
                    f"{fn.p(50) / level.p(50):.2f}x" if fn and level.latencies else "—",
                )
        self.console.print(t)
        if not self.args.fusion_url:
            self.console.print(f"SandboxFusion: {FUSION_PRIOR}.")

    # ------------------------------------------------------------------ 4. CPU

    async def part_cpu(self, client: AsyncClient) -> None:
        c = max(self.levels)
        n = self.counts.cpu_calls
        cores = os.cpu_count() or 1
        runs: list[tuple[str, Level, dict[str, float], list[int]]] = []
        for name, runner in (("closed loop", run_level), ("rounds", run_rounds)):
            await self.wait_idle(client, self.min_workers)
            before = self.snap()
            level = await runner(c, n, self.fncall_call(client))
            after = self.snap()
            faults = [a - b for a, b in zip(after.faults, before.faults, strict=True)]
            runs.append((name, level, after.since(before), faults))
        t = self.table(
            f"4. CPU per call: {n} SDK calls at concurrency {c}, as a closed loop and in rounds "
            "(as in part 1); ms of CPU per call (after - before) / calls",
            "where",
            *(
                f"{name}: {lv.rate:.0f} calls/s, p50 {ms(lv.p(50))}, failed {lv.failures()}"
                for name, lv, _, _ in runs
            ),
        )
        for key in runs[0][2]:
            cells = []
            for _, lv, spent, _ in runs:
                total = spent["whole machine (/proc/stat busy)"]
                sec = spent[key]
                if key.startswith("whole"):
                    share = f"{total / (lv.wall * cores):.0%} busy of {cores} cores"
                else:
                    share = f"{sec / total:.0%}" if total else ""
                cells.append(f"{sec * 1000 / n:.3f} ({share})")
            t.add_row(key, *cells)
        t.add_row(
            "minor page faults per call: zygotes / calls' processes",
            *(f"{f[0] / n:.0f} / {f[1] / n:.0f}" for _, _, _, f in runs),
        )
        self.console.print(t)
        for name, _, spent, _ in runs:
            total = spent["whole machine (/proc/stat busy)"]
            ceiling = cores * n / total if total else math.inf
            client_s = spent["this client (AsyncClient, asyncio, one process)"]
            server = sum(v for k, v in spent.items() if k in self.procs or k.startswith("workers"))
            self.summary.append(
                f"CPU ({name}, c={c}): {total * 1000 / n:.2f} ms of machine CPU per call -> a "
                f"ceiling of {ceiling:.0f} calls/s on {cores} cores; server side (control plane"
                f" + node + workers) {server * 1000 / n:.2f} ms per call, client "
                f"{client_s * 1000 / n:.2f} ms"
            )

    # ------------------------------------------------------------------ 5. memory

    async def part_memory(self, client: AsyncClient) -> None:
        idle_n = self.args.idle_workers
        drop = not self.args.no_drop_caches
        before = await asyncio.to_thread(memory_in_use, drop)
        before_workers = len(worker_cgroups("memory", self.node_id))
        await self.configure(client, idle_n, max(idle_n, self.workers))
        await self.wait_idle(client, idle_n)
        await asyncio.sleep(2.0)  # let the new workers settle
        after = await asyncio.to_thread(memory_in_use, drop)
        pools = await self.print_pools(
            client, f"5a. pool state with min_workers={idle_n} (client.pools())"
        )
        groups = worker_cgroups("memory", self.node_id)
        n = len(groups)
        pids = [p for d in groups for p in cgroup_pids(d)]
        rss = sum(proc_kib(p, "status", "VmRSS") for p in pids)
        pss = sum(proc_kib(p, "smaps_rollup", "Pss") for p in pids)
        charge = sum(cgroup_charge(d) for d in groups) / 1024
        rss_api = [p.worker_memory_mb for p in pools if p.worker_memory_mb is not None]
        added = n - before_workers
        t = self.table(
            f"5. memory per idle worker: {n} idle workers ({len(pids)} processes in their "
            f"fw-* memory cgroups)",
            "what",
            "per worker",
            "total",
        )
        api = statistics.fmean(rss_api) if rss_api else math.nan
        t.add_row(
            "worker_memory_mb from client.pools()",
            "—" if math.isnan(api) else f"{api:.2f} MiB",
            "",
        )
        if n:
            for what, kib in (
                ("RSS of the processes in the workers' cgroups", rss),
                ("PSS (smaps_rollup) of those processes", pss),
                ("memory cgroup charge (usage_in_bytes / memory.current)", charge),
            ):
                t.add_row(what, f"{kib / n / 1024:.2f} MiB", f"{kib / 1024:.0f} MiB")
        else:
            t.add_row("no fw-* memory cgroups found on this host", "—", "")
        if added > 0:
            t.add_row(
                f"host (MemTotal - MemAvailable) growth, {before_workers} -> {n} workers",
                f"{(after - before) / added / 1024:.2f} MiB",
                f"{(after - before) / 1024:.0f} MiB",
            )
        self.console.print(t)
        how = "after `sync; echo 3 > drop_caches`" if drop else "no cache drop"
        self.console.print(
            f"host growth: medians of 5 samples 0.5 s apart, {how}, / {added} added workers"
        )
        if n:
            self.summary.append(
                f"memory per idle worker: PSS {pss / n / 1024:.2f} MiB, RSS "
                f"{rss / n / 1024:.2f} MiB, cgroup charge {charge / n / 1024:.2f} MiB, "
                f"pools() {api:.2f} MiB"
                + (f", host growth {(after - before) / added / 1024:.2f} MiB" if added > 0 else "")
            )

    # ------------------------------------------------------------------ run

    def goals(self) -> str:
        runs = [("SDK", c, lv) for c, lv in self.fn.items()]
        runs += [("SDK, rounds", c, lv) for c, lv in self.rounds.items()]
        path, best_c, best = max(runs, key=lambda r: r[2].rate)
        p50 = self.fn[self.levels[0]].p(50)
        rate_ok = "met" if best.rate >= GOAL_RATE else "NOT met"
        p50_ok = "met" if p50 <= GOAL_P50 else "NOT met"
        return (
            f"goals: ≥ 1,000 calls/s: best {best.rate:.0f} calls/s ({path}, concurrency "
            f"{best_c}, p50 {ms(best.p(50))}) ({rate_ok}); p50 ≤ 3 ms: {ms(p50)} at "
            f"concurrency {self.levels[0]} ({p50_ok})"
        )

    async def _main(self) -> None:
        async with AsyncClient(self.url, timeout_s=120.0) as client:
            await self.configure(client, self.min_workers, self.workers)
            try:
                await self.part_fncall(client)
                await self.part_baseline(client)
                await self.part_fusion()
                await self.part_cpu(client)
                await self.part_memory(client)
            finally:
                await self.destroy_boxes()
        self.console.print(self.goals())
        for line in self.summary:
            self.console.print(line)

    def run(self) -> None:
        self.console.print(
            f"sandfleet fncall benchmark: {FNCALL_IMAGE}, {os.cpu_count()} cores, "
            f"loadavg {loadavg()}, "
            + (f"state {self.state}" if self.state else f"server {self.url}")
        )
        if self.dep is not None and self.state is not None:
            self.dep.start()
            self.procs = deployment_pids(self.state)
        asyncio.run(self._main())
        self.console.print(f"loadavg at the end: {loadavg()}")

    def cleanup(self) -> list[str]:
        """Stop the local deployment (its workers go with it); returns leftovers."""
        if self.boxes:
            with contextlib.suppress(Exception):
                asyncio.run(self._destroy_with_new_client())
        if self.dep is None or self.state is None:
            return []
        self.dep.stop()
        return leftovers(self.state)

    async def _destroy_with_new_client(self) -> None:
        async with AsyncClient(self.url, timeout_s=30.0) as client:
            ids = [sb.id for sb in self.boxes]
            self.boxes = [await client.get(i) for i in ids]
            await self.destroy_boxes()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _levels(text: str) -> list[int]:
    levels = sorted({int(x) for x in text.split(",") if x.strip()})
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError("levels: comma-separated positive integers")
    return levels


def main() -> int:
    default_images = (
        Path(os.environ.get("SANDFLEET_TEST_CACHE", "/var/tmp/sandfleet-test-cache")) / "images"
    )
    cores = os.cpu_count() or 1
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--url", help="a running control plane (default: start a local one)")
    ap.add_argument(
        "--images-dir",
        type=Path,
        default=default_images,
        help=f"image store of the local deployment (default {default_images})",
    )
    ap.add_argument("--levels", type=_levels, default=[1, 8, 64], help="default 1,8,64")
    ap.add_argument("--calls", type=int, help="fncall calls per level (default 2000)")
    ap.add_argument("--baseline-calls", type=int, help="baseline calls per level (default 200)")
    ap.add_argument("--cpu-calls", type=int, help="calls of the CPU breakdown (default 2000)")
    ap.add_argument(
        "--workers", type=int, default=2 * cores, help=f"max_workers (default {2 * cores})"
    )
    ap.add_argument("--min-workers", type=int, help="min_workers (default: --workers)")
    ap.add_argument(
        "--idle-workers", type=int, default=32, help="idle workers measured in part 5 (default 32)"
    )
    ap.add_argument("--fusion-url", help="a running SandboxFusion server to measure as well")
    ap.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    ap.add_argument(
        "--no-drop-caches",
        action="store_true",
        help="do not drop the page cache before the memory samples",
    )
    args = ap.parse_args()
    if args.url is None and os.geteuid() != 0:
        print("bench_fncall.py must run as root (runc, mounts, cgroups)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    console = Console()
    state: Path | None = None
    if args.url is None:
        ensure_fncall_image(args.images_dir, sys.stderr)
        # /var/tmp: on disk, like the other benchmarks' state
        state = Path(tempfile.mkdtemp(prefix="sandfleet-bench-fncall-", dir="/var/tmp"))
    bench = Bench(args, state)
    left: list[str] = []
    ok = False
    try:
        bench.run()
        ok = True
    finally:
        left = bench.cleanup()
        if left:
            console.print("[red]left behind:[/]\n  " + "\n  ".join(left))
            console.print(f"state dir kept for inspection: {state}")
        elif state is not None:
            console.print("leftovers(state_dir): none")
            if not ok and bench.dep is not None:
                notable = [
                    line
                    for line in bench.dep.log().splitlines()
                    if any(w in line for w in ("WARNING", "ERROR", "Traceback"))
                ]
                console.print("the deployment's warnings and errors:\n" + "\n".join(notable[-40:]))
            if not mounts_under(state):
                shutil.rmtree(state, ignore_errors=True)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
