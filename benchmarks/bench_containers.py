"""Container sandboxes, measured end to end on a real local deployment.

Starts ``sandfleet up`` (LocalDeployment) in a fresh state directory under
/var/tmp and uses the Debian base image ``sandfleet/bookworm-python:1`` with the
workspace ``workspace/more-itertools:10.5.0`` (built by ``ensure_demo_images``
if missing). Every figure is wall-clock time from ``time.perf_counter`` or a
/proc counter; nothing is asserted. What is measured, and how:

1. create -> first exec (``true``) done, async SDK: N sequential sandboxes (1 in
   flight) and N with 8 workers in flight; p50/p99. Each sandbox is destroyed
   after it is measured (the destroy is outside the figure, but inside the
   worker's slot, so "8 in flight" counts destroys too).
2. Sustained creations/s: N sandboxes with 16 workers (create, exec ``true``,
   destroy); count / wall. Then, destroys excluded: N sandboxes created (+ first
   exec) with 16 in flight, count / wall; the destroy of all of them is timed apart.
3. Exec round trip of ``true`` on one running sandbox, sequentially: sync
   ``Client``, ``AsyncClient``, the node agent's HTTP API directly (no control
   plane) and ``AgentClient`` on the box's Unix socket (no HTTP at all), plus the
   agent's own ``duration_s`` (fork/exec/wait inside the box).
4. Idle memory, measured last (dropping caches would slow what follows): N
   sandboxes (memory_mb=64) created and left idle; (MemTotal - MemAvailable)
   after - before, divided by N, both sides the median of 5 samples taken after
   ``sync; echo 3 > /proc/sys/vm/drop_caches`` and a 2 s pause
   (``--no-drop-caches`` skips the drop). Also: the sum of RSS and PSS of the
   processes in the boxes' cgroups / N, the delta of Slab + PageTables +
   KernelStack / N, and the mean memory cgroup charge. The host-wide figures
   include whatever else runs on the host meanwhile; a third sample after
   destroying them all shows that noise.
5. Baseline without sandfleet: the same layers under a fresh overlay of our
   own, a copy of a sandbox's config.json with args ``/bin/sleep infinity``,
   then ``runc run -d`` and ``runc exec <id> true`` timed as subprocesses.

Run as root: ``python benchmarks/bench_containers.py [--images-dir DIR] [--quick]``.
Everything created is destroyed, also on Ctrl-C or an error, and the run ends
with ``sandfleet.node.leaks.leftovers(state_dir)`` (scoped to this deployment's node).
Writes nothing but stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from sandfleet.cli.demo import ensure_demo_images
from sandfleet.cli.local import LocalDeployment
from sandfleet.guest.client import AgentClient
from sandfleet.node.leaks import leftovers
from sandfleet.node.mounts import MNT_DETACH, mount, mounts_under, umount
from sandfleet.sdk import AsyncClient, AsyncSandbox, Client
from sandfleet.wire.errors import ResourceExhausted, Unavailable
from sandfleet.wire.models import ExecRequest

IMAGE = "sandfleet/bookworm-python:1"
WORKSPACE = "workspace/more-itertools:10.5.0"
MEMORY_MB = 64
TRUE = ["true"]
CREATE_ATTEMPTS = 30


@dataclass(frozen=True)
class Counts:
    """How many of each thing one run measures."""

    serial: int  # create -> first exec, 1 in flight
    parallel: int  # create -> first exec, 8 in flight
    sustained: int  # create/exec/destroy cycles and idle sandboxes, 16 in flight
    execs: int  # exec round trips per path
    runc_runs: int  # runc run -d baseline
    runc_execs: int  # runc exec baseline


FULL = Counts(serial=40, parallel=80, sustained=200, execs=500, runc_runs=20, runc_execs=50)
QUICK = Counts(serial=10, parallel=16, sustained=20, execs=50, runc_runs=5, runc_execs=20)


# ---------------------------------------------------------------------- helpers


def pct(samples: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100) of ``samples``."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def meminfo() -> dict[str, int]:
    """/proc/meminfo in KiB."""
    out: dict[str, int] = {}
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0])
    return out


def memory_sample(drop_caches: bool, samples: int = 5, gap_s: float = 0.5) -> dict[str, float]:
    """Median over ``samples`` of memory in use and of kernel memory, in KiB."""
    if drop_caches:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as fh:
            fh.write("3\n")
    time.sleep(2.0)
    in_use, kernel = [], []
    for _ in range(samples):
        m = meminfo()
        in_use.append(m["MemTotal"] - m["MemAvailable"])
        kernel.append(m["Slab"] + m["PageTables"] + m["KernelStack"])
        time.sleep(gap_s)
    return {"in_use": statistics.median(in_use), "kernel": statistics.median(kernel)}


def _cgroup_dir(controller: str, sandbox_id: str) -> Path | None:
    for base in (f"/sys/fs/cgroup/{controller}", "/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        d = Path(base) / "sandfleet" / sandbox_id
        if (d / "cgroup.procs").exists():
            return d
    return None


def box_pids(sandbox_id: str) -> list[int]:
    d = _cgroup_dir("memory", sandbox_id) or _cgroup_dir("pids", sandbox_id)
    if d is None:
        return []
    return [int(x) for x in (d / "cgroup.procs").read_text().split()]


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


def cgroup_charge(sandbox_id: str) -> int:
    """Bytes charged to the box's memory cgroup (v1 usage_in_bytes or v2 memory.current)."""
    d = _cgroup_dir("memory", sandbox_id)
    if d is None:
        return 0
    for name in ("memory.usage_in_bytes", "memory.current"):
        with contextlib.suppress(OSError):
            return int((d / name).read_text())
    return 0


def deployment_pids(state: Path) -> list[int]:
    """The processes of the deployment using ``state``: ``sandfleet up`` and its node agent."""
    needle = f"--state-dir\0{state}\0".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
    return pids


def deployment_rss_kib(state: Path) -> int:
    """Sum of VmRSS of the control plane and node agent processes using ``state``."""
    return sum(proc_kib(pid, "status", "VmRSS") for pid in deployment_pids(state))


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# ---------------------------------------------------------------------- the benchmark


class Bench:
    """One run: a deployment, the sandboxes made in it, and the figures measured."""

    def __init__(self, state: Path, images: Path, counts: Counts, drop_caches: bool) -> None:
        self.state = state
        self.images = images
        self.counts = counts
        self.drop_caches = drop_caches
        console = Console()
        # piped output: wide enough for the summary table instead of rich's 80 columns
        self.console = console if console.is_terminal else Console(width=170)
        self.dep = LocalDeployment(state, images)
        self.node_dir = state / "nodes" / self.dep.node_id / "container"
        self.ids: set[str] = set()  # every sandbox this run created (for the leak check)
        # Named so that leaks.leftovers covers them: it scans **/runc and **/sandboxes.
        self.runc_root = state / "bench" / "runc"
        self.runc_boxes: dict[str, Path] = {}
        self.node_boxes: set[str] = set()  # created on the node directly, unknown to the CP
        self.retries: list[str] = []  # create attempts refused and retried
        # summary rows: what, value, goal, method
        self.rows: list[tuple[str, str, str, str]] = []
        self.fig: dict[str, float] = {}

    # ------------------------------------------------------------------ plumbing

    async def create(self, client: AsyncClient) -> AsyncSandbox:
        """Create one sandbox; retried, as the SDK documents, on ResourceExhausted/Unavailable.

        Retries are counted in ``self.retries`` (and reported): on this loaded 2-core
        host the control plane now and then sees the node as unhealthy or full.
        """
        for attempt in range(CREATE_ATTEMPTS):
            try:
                sb = await client.create(image=IMAGE, workspace=WORKSPACE, memory_mb=MEMORY_MB)
            except (ResourceExhausted, Unavailable) as exc:
                if attempt == CREATE_ATTEMPTS - 1:
                    raise
                self.retries.append(f"{type(exc).__name__}: {str(exc)[:100]}")
                await asyncio.sleep(0.1)
                continue
            self.ids.add(sb.id)
            return sb
        raise AssertionError("unreachable")

    async def create_first_exec(self, client: AsyncClient) -> tuple[float, float, AsyncSandbox]:
        """Seconds for create and for the first exec, and the sandbox."""
        t0 = time.perf_counter()
        sb = await self.create(client)
        t1 = time.perf_counter()
        try:
            result = await sb.exec(TRUE)
        except BaseException:
            await sb.destroy()
            raise
        t2 = time.perf_counter()
        if not result.ok:
            await sb.destroy()
            raise RuntimeError(f"`true` failed in {sb.id}: {result}")
        return t1 - t0, t2 - t1, sb

    def measured(
        self, client: AsyncClient, creates: list[float], execs: list[float]
    ) -> Callable[[int], Awaitable[None]]:
        """A job for :meth:`workers`: create -> first exec timed into the lists, then destroy."""

        async def job(_: int) -> None:
            c, e, sb = await self.create_first_exec(client)
            creates.append(c)
            execs.append(e)
            await sb.destroy()

        return job

    @staticmethod
    async def workers(n: int, in_flight: int, job: Callable[[int], Awaitable[None]]) -> float:
        """Run ``job(i)`` for i in 0..n-1 on ``in_flight`` workers; wall seconds."""
        it = iter(range(n))

        async def worker() -> None:
            for i in it:
                await job(i)

        t0 = time.perf_counter()
        async with asyncio.TaskGroup() as tg:  # one failure cancels (and awaits) the rest
            for _ in range(in_flight):
                tg.create_task(worker())
        return time.perf_counter() - t0

    def row(self, what: str, value: str, goal: str, method: str) -> None:
        self.rows.append((what, value, goal, method))

    def table(self, title: str, *columns: str) -> Table:
        return Table(*columns, title=title, title_justify="left")

    # ------------------------------------------------------------------ phases

    async def warm_up(self, client: AsyncClient) -> None:
        """Mount the layers and warm caches: 3 sandboxes, not counted."""
        for _ in range(3):
            sb = (await self.create_first_exec(client))[2]
            await sb.destroy()

    async def latency(self, client: AsyncClient) -> None:
        t = self.table(
            "1. create -> first exec (`true`) done, async SDK",
            "in flight",
            "n",
            "p50",
            "p99",
            "create p50",
            "1st exec p50",
            "wall",
        )
        for in_flight, n in ((1, self.counts.serial), (8, self.counts.parallel)):
            creates: list[float] = []
            execs: list[float] = []
            wall = await self.workers(n, in_flight, self.measured(client, creates, execs))
            totals = [c + e for c, e in zip(creates, execs, strict=True)]
            self.fig[f"cfe{in_flight}_p50"] = pct(totals, 50)
            t.add_row(
                str(in_flight),
                str(n),
                ms(pct(totals, 50)),
                ms(pct(totals, 99)),
                ms(pct(creates, 50)),
                ms(pct(execs, 50)),
                f"{wall:.1f} s",
            )
            method = (
                f"{n} sandboxes, {'sequential' if in_flight == 1 else '8 workers'}; "
                "AsyncClient.create + exec(['true']) timed, destroy after (untimed)"
            )
            goal = "≤ 100 ms" if in_flight == 1 else "—"
            self.row(
                f"create → first exec, p50 ({in_flight} in flight)",
                ms(pct(totals, 50)),
                goal,
                method,
            )
            self.row(
                f"create → first exec, p99 ({in_flight} in flight)",
                ms(pct(totals, 99)),
                "—",
                method,
            )
        # Breakdown: the same at 1 in flight straight to the node agent (no control plane).
        n = self.counts.serial
        creates, execs = await asyncio.to_thread(self.node_direct_creates, n)
        totals = [c + e for c, e in zip(creates, execs, strict=True)]
        t.add_row(
            "1, node API",
            str(n),
            ms(pct(totals, 50)),
            ms(pct(totals, 99)),
            ms(pct(creates, 50)),
            ms(pct(execs, 50)),
            "",
        )
        self.console.print(t)
        self.row(
            "create → first exec via the node API directly (1 in flight), p50 / p99",
            f"{ms(pct(totals, 50))} / {ms(pct(totals, 99))}",
            "—",
            f"{n} sequential POST /v1/sandboxes + POST .../exec on the node (no control plane);"
            f" create alone p50 {ms(pct(creates, 50))}",
        )

    def node_http(self) -> httpx.Client:
        token = (self.state / "node-token").read_text().strip()  # cluster token of `up`
        return httpx.Client(
            base_url=f"http://127.0.0.1:{self.dep.node_port}",
            headers={"Authorization": f"Bearer {token}"},
            timeout=60.0,
        )

    def node_direct_creates(self, n: int) -> tuple[list[float], list[float]]:
        """``n`` sequential create + exec ``true`` on the node's own API; seconds each."""
        creates: list[float] = []
        execs: list[float] = []
        body = {"image": IMAGE, "workspace": WORKSPACE, "memory_mb": MEMORY_MB}
        exec_body = ExecRequest(cmd=TRUE).model_dump(mode="json")
        with self.node_http() as h:
            for _ in range(n):
                sid = f"sb-{secrets.token_hex(6)}-{self.dep.node_id}"
                self.ids.add(sid)
                self.node_boxes.add(sid)
                t0 = time.perf_counter()
                h.post("/v1/sandboxes", json={**body, "id": sid}).raise_for_status()
                t1 = time.perf_counter()
                h.post(f"/v1/sandboxes/{sid}/exec", json=exec_body).raise_for_status()
                t2 = time.perf_counter()
                h.delete(f"/v1/sandboxes/{sid}").raise_for_status()
                self.node_boxes.discard(sid)
                creates.append(t1 - t0)
                execs.append(t2 - t1)
        return creates, execs

    async def create_many(self, client: AsyncClient, n: int, boxes: list[AsyncSandbox]) -> float:
        """Create ``n`` sandboxes (+ first exec) on 16 workers into ``boxes``; wall seconds."""

        async def make(_: int) -> None:
            boxes.append((await self.create_first_exec(client))[2])

        return await self.workers(n, 16, make)

    async def destroy_many(self, boxes: list[AsyncSandbox]) -> float:
        """Destroy ``boxes`` on 16 workers; wall seconds."""
        queue = list(boxes)

        async def kill(i: int) -> None:
            await queue[i].destroy()

        wall = await self.workers(len(queue), 16, kill)
        boxes.clear()
        return wall

    async def throughput(self, client: AsyncClient) -> None:
        n = self.counts.sustained
        t = self.table("2. sustained creations, 16 in flight", "what", "n", "wall", "rate")

        async def cycle(_: int) -> None:
            sb = (await self.create_first_exec(client))[2]
            await sb.destroy()

        wall = await self.workers(n, 16, cycle)
        t.add_row("create + exec `true` + destroy", str(n), f"{wall:.2f} s", f"{n / wall:.1f}/s")
        self.row(
            "sustained creations/s (create + exec + destroy)",
            f"{n / wall:.1f}/s",
            "≥ 50/s",
            f"{n} cycles of create, exec `true`, destroy on 16 workers; n / wall",
        )
        boxes: list[AsyncSandbox] = []
        try:
            wall = await self.create_many(client, n, boxes)
        finally:
            dwall = await self.destroy_many(boxes)
        t.add_row("create + exec `true` (no destroy)", str(n), f"{wall:.2f} s", f"{n / wall:.1f}/s")
        t.add_row("then destroy all", str(n), f"{dwall:.2f} s", f"{n / dwall:.1f}/s")
        self.console.print(t)
        self.row(
            "creations/s, destroys excluded",
            f"{n / wall:.1f}/s",
            "≥ 50/s",
            f"{n} sandboxes created (+ first exec) on 16 workers, none destroyed; n / wall",
        )
        self.row(
            "destroys/s",
            f"{n / dwall:.1f}/s",
            "—",
            f"then those {n} destroyed on 16 workers; n / wall",
        )

    async def memory(self, client: AsyncClient) -> None:
        """Idle sandboxes: memory before, create n, settle, after, destroy, after again."""
        n = self.counts.sustained
        before = await asyncio.to_thread(memory_sample, self.drop_caches)
        up_before = deployment_rss_kib(self.state)
        # Stay idle well past uvicorn's 5 s keep-alive timeout: a burst sent just as the
        # server closes pooled connections can fail (SDK: Unavailable/ReadError; control
        # plane -> node: the node counts as refused, "all nodes full").
        await asyncio.sleep(2.0)
        boxes: list[AsyncSandbox] = []
        try:
            await self.create_many(client, n, boxes)
            await asyncio.sleep(3.0)  # let the boxes settle
            after = await asyncio.to_thread(memory_sample, self.drop_caches)
            pids = [p for sb in boxes for p in box_pids(sb.id)]
            rss = sum(proc_kib(p, "status", "VmRSS") for p in pids)
            pss = sum(proc_kib(p, "smaps_rollup", "Pss") for p in pids)
            charge = sum(cgroup_charge(sb.id) for sb in boxes) / 1024
            up = (deployment_rss_kib(self.state) - up_before) / n
            await asyncio.sleep(2.0)  # as above
        finally:
            await self.destroy_many(boxes)
        gone = await asyncio.to_thread(memory_sample, self.drop_caches)
        host = (after["in_use"] - before["in_use"]) / n
        kernel = (after["kernel"] - before["kernel"]) / n
        drift = gone["in_use"] - before["in_use"]
        kdrift = gone["kernel"] - before["kernel"]
        drop = "after `sync; echo 3 > drop_caches`" if self.drop_caches else "no cache drop"
        t = self.table(
            f"4. {n} idle sandboxes (memory_mb={MEMORY_MB}), {len(pids)} processes in them",
            "what",
            "per sandbox",
            "total",
        )
        for what, kib in (
            ("host memory in use (MemTotal - MemAvailable) delta", host),
            ("Slab + PageTables + KernelStack delta", kernel),
            ("RSS of the processes in the boxes", rss / n),
            ("PSS of the processes in the boxes", pss / n),
            ("memory cgroup charge (usage_in_bytes / memory.current)", charge / n),
            ("control plane + node agent processes RSS growth", up),
        ):
            t.add_row(what, f"{kib / 1024:.2f} MiB", f"{kib * n / 1024:.0f} MiB")
        t.add_row(
            "noise check: in use after destroying all - before", "", f"{drift / 1024:.0f} MiB"
        )
        t.add_row(
            "noise check: kernel after destroying all - before", "", f"{kdrift / 1024:.0f} MiB"
        )
        self.console.print(t)
        method = (
            f"median of 5 samples before / after, {drop}; / {n}; after destroying all "
            f"the in-use delta was {drift / 1024:+.0f} MiB"
        )
        self.row(
            f"host memory per idle sandbox ({n} idle)",
            f"{host / 1024:.2f} MiB",
            "≤ 3 MiB",
            f"(MemTotal - MemAvailable) delta, {method}",
        )
        self.row(
            "kernel memory per idle sandbox",
            f"{kernel / 1024:.2f} MiB",
            "≤ 3 MiB",
            f"Slab + PageTables + KernelStack delta, same samples (after destroying all: "
            f"{kdrift / 1024:+.0f} MiB)",
        )
        self.row(
            "agent RSS per idle sandbox",
            f"{rss / n / 1024:.2f} MiB",
            "≤ 3 MiB",
            f"sum of VmRSS of the {len(pids)} processes in the boxes' cgroups / {n}"
            f" (PSS: {pss / n / 1024:.2f} MiB)",
        )
        self.row(
            "memory cgroup charge per idle sandbox",
            f"{charge / n / 1024:.2f} MiB",
            "—",
            "mean memory.usage_in_bytes of the boxes' memory cgroups",
        )

        self.row(
            "control plane + node agent RSS growth per idle sandbox",
            f"{up / 1024:.2f} MiB",
            "—",
            f"VmRSS of the `sandfleet up` and node agent processes, after - before, / n "
            f"({up_before / 1024:.0f} MiB before)",
        )

    async def exec_round_trips(self, client: AsyncClient) -> None:
        n = self.counts.execs
        sb = (await self.create_first_exec(client))[2]
        try:
            sock = self.node_dir / "sandboxes" / sb.id / "agent.sock"
            times: dict[str, list[float]] = {}
            agent_side: list[float] = []

            def sync_sdk() -> list[float]:
                with Client(self.dep.url) as c:
                    box = c.get(sb.id)
                    return [timed_sync(lambda: box.exec(TRUE)) for _ in range(n + 20)][20:]

            def sync_node() -> list[float]:
                body = ExecRequest(cmd=TRUE).model_dump(mode="json")
                with self.node_http() as h:
                    path = f"/v1/sandboxes/{sb.id}/exec"

                    def call() -> None:
                        h.post(path, json=body).raise_for_status()

                    return [timed_sync(call) for _ in range(n + 20)][20:]

            times["sync Client (SDK → control plane → node → agent)"] = await asyncio.to_thread(
                sync_sdk
            )
            out = []
            for _ in range(n + 20):
                t0 = time.perf_counter()
                await sb.exec(TRUE)
                out.append(time.perf_counter() - t0)
            times["AsyncClient (SDK → control plane → node → agent)"] = out[20:]
            times["node HTTP API directly (httpx, sync)"] = await asyncio.to_thread(sync_node)
            agent = AgentClient(sock)
            req = ExecRequest(cmd=TRUE)
            out = []
            for _ in range(n + 20):
                t0 = time.perf_counter()
                r = await agent.exec(req)
                out.append(time.perf_counter() - t0)
                agent_side.append(r.duration_s)
            times["AgentClient on the box's socket (no HTTP)"] = out[20:]
            times["  of which the agent's own duration_s (fork/exec/wait)"] = agent_side[20:]
        finally:
            await sb.destroy()
        t = self.table(
            f"3. exec round trip of `true`, {n} sequential calls (after 20 warm-up)",
            "path",
            "p50",
            "p99",
            "mean",
        )
        for path, xs in times.items():
            t.add_row(path, ms(pct(xs, 50)), ms(pct(xs, 99)), ms(statistics.fmean(xs)))
        self.console.print(t)
        keys = list(times)
        self.fig["exec_async_p50"] = pct(times[keys[1]], 50)
        for key, label, goal in (
            (keys[0], "exec `true` round trip, sync Client", "p50 ≤ 5 ms"),
            (keys[1], "exec `true` round trip, AsyncClient", "p50 ≤ 5 ms"),
            (keys[2], "exec via node HTTP API directly", "—"),
            (keys[3], "exec via AgentClient on the socket", "—"),
            (keys[4], "agent-side duration_s of `true`", "—"),
        ):
            xs = times[key]
            self.row(
                f"{label}, p50 / p99",
                f"{ms(pct(xs, 50))} / {ms(pct(xs, 99))}",
                goal,
                f"{n} sequential calls on one running sandbox after 20 warm-up",
            )

    # ------------------------------------------------------------------ runc baseline

    async def runc_baseline(self, client: AsyncClient) -> None:
        """runc directly on the same layers, with a copy of a sandbox's config.json."""
        template = (await self.create_first_exec(client))[2]
        try:
            bundle = self.node_dir / "sandboxes" / template.id
            config = json.loads((bundle / "config.json").read_text())
            lowers = _overlay_lowerdir(bundle / "rootfs")
        finally:
            await template.destroy()  # layer mounts stay: the node keeps them as a cache
        self.runc_root.mkdir(parents=True, exist_ok=True)
        mounts, runs, first_execs, execs = [], [], [], []
        for i in range(self.counts.runc_runs):
            # ends with the node id: leaks.leftovers then checks its cgroups too
            rid = f"runc-{secrets.token_hex(6)}-{self.dep.node_id}"
            self.ids.add(rid)
            b = self.state / "bench" / "sandboxes" / rid
            for sub in ("upper", "work", "rootfs"):
                (b / sub).mkdir(parents=True)
            self.runc_boxes[rid] = b
            cfg = json.loads(json.dumps(config))
            cfg["process"]["args"] = ["/bin/sleep", "infinity"]
            cfg["hostname"] = rid
            cfg["linux"]["cgroupsPath"] = f"/sandfleet/{rid}"
            (b / "config.json").write_text(json.dumps(cfg))
            t0 = time.perf_counter()
            mount(
                "overlay",
                b / "rootfs",
                "overlay",
                0,
                f"lowerdir={lowers},upperdir={b / 'upper'},workdir={b / 'work'},volatile",
            )
            t1 = time.perf_counter()
            with open(b / "log", "ab") as log:  # runc hands its stdio to the box: no pipes
                rc = subprocess.run(
                    [
                        self._runc(),
                        "--root",
                        str(self.runc_root),
                        "run",
                        "-d",
                        "--bundle",
                        str(b),
                        rid,
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    check=False,
                ).returncode
            t2 = time.perf_counter()
            if rc != 0:
                raise RuntimeError(f"runc run failed ({rc}): {(b / 'log').read_text()[-500:]}")
            first_execs.append(self._runc_exec(rid))
            mounts.append(t1 - t0)
            runs.append(t2 - t1)
            if i == 0:
                execs = [self._runc_exec(rid) for _ in range(self.counts.runc_execs)]
            await asyncio.to_thread(self._runc_destroy, rid)
        t = self.table(
            "5. baseline: runc directly, same layers and config (args: sleep)",
            "what",
            "n",
            "p50",
            "p99",
        )
        composite = [m + r + e for m, r, e in zip(mounts, runs, first_execs, strict=True)]
        for what, xs in (
            ("overlay mount", mounts),
            ("runc run -d", runs),
            ("first runc exec true", first_execs),
            ("mount + run -d + first exec", composite),
            ("runc exec true (running container)", execs),
        ):
            t.add_row(what, str(len(xs)), ms(pct(xs, 50)), ms(pct(xs, 99)))
        self.console.print(t)
        nr, ne = self.counts.runc_runs, self.counts.runc_execs
        self.row(
            "runc run -d, p50",
            ms(pct(runs, 50)),
            "—",
            f"{nr} containers on a fresh overlay of the same layers, sandbox config.json "
            "with args /bin/sleep infinity; subprocess wall time",
        )
        self.row(
            "overlay mount + runc run -d + runc exec true, p50",
            ms(pct(composite, 50)),
            "—",
            f"same {nr} containers; the raw-runc equivalent of create → first exec",
        )
        self.row(
            "runc exec true, p50",
            ms(pct(execs, 50)),
            "—",
            f"{ne} sequential `runc exec <id> true` into one running container",
        )
        cfe = self.fig["cfe1_p50"]
        ex = self.fig["exec_async_p50"]
        self.row(
            "ratio: sandfleet create → first exec / raw runc (mount + run + exec)",
            f"{cfe / pct(composite, 50):.2f}x",
            "—",
            "p50 / p50, 1 in flight",
        )
        self.row(
            "ratio: sandfleet exec (AsyncClient) / runc exec",
            f"{ex / pct(execs, 50):.2f}x",
            "—",
            "p50 / p50",
        )

    def _runc(self) -> str:
        return shutil.which("runc") or "runc"

    def _runc_exec(self, rid: str) -> float:
        t0 = time.perf_counter()
        rc = subprocess.run(
            [self._runc(), "--root", str(self.runc_root), "exec", rid, "true"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            check=False,
        ).returncode
        elapsed = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"runc exec {rid} true exited {rc}")
        return elapsed

    def _runc_destroy(self, rid: str) -> None:
        b = self.runc_boxes[rid]
        subprocess.run(
            [self._runc(), "--root", str(self.runc_root), "delete", "--force", rid],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
        )
        for point in mounts_under(b):
            try:
                umount(point)
            except OSError:
                umount(point, MNT_DETACH)
        if not mounts_under(b):
            shutil.rmtree(b, ignore_errors=True)
            del self.runc_boxes[rid]

    # ------------------------------------------------------------------ run

    async def _main(self) -> None:
        async with AsyncClient(self.dep.url) as client:
            await self.warm_up(client)
            await self.latency(client)
            await self.throughput(client)
            await self.exec_round_trips(client)
            await self.runc_baseline(client)
            await self.memory(client)  # last: dropping caches would slow what follows

    def run(self) -> None:
        self.console.print(
            f"sandfleet container benchmark: {IMAGE} + {WORKSPACE}, {os.cpu_count()} cores, "
            f"loadavg {loadavg()}, state {self.state}"
        )
        self.dep.start()
        asyncio.run(self._main())
        t = self.table("summary", "what", "value", "goal", "method")
        for r in self.rows:
            t.add_row(*r)
        self.console.print(t)
        self.console.print(f"loadavg at the end: {loadavg()}")
        kinds = sorted({r[:90] for r in self.retries})
        self.console.print(
            f"create attempts refused and retried after 0.1 s: {len(self.retries)}"
            + ("".join(f"\n  {k}" for k in kinds) if kinds else "")
        )

    def cleanup(self) -> list[str]:
        """Destroy everything this run made, stop the deployment; returns leftovers."""
        for rid in list(self.runc_boxes):
            with contextlib.suppress(Exception):
                self._runc_destroy(rid)
        if self.node_boxes:
            with contextlib.suppress(Exception), self.node_http() as h:
                for sid in list(self.node_boxes):
                    h.delete(f"/v1/sandboxes/{sid}")
        with contextlib.suppress(Exception), Client(self.dep.url, timeout_s=30) as c:
            for info in c.list():  # our own control plane: every sandbox listed is ours
                self.ids.add(info.id)
                with contextlib.suppress(Exception):
                    c.get(info.id).destroy()
        self.dep.stop()
        return leftovers(self.state)


def timed_sync(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _overlay_lowerdir(point: Path) -> str:
    """The lowerdir= option of the overlay mounted at ``point`` (from mountinfo)."""
    target = os.path.realpath(point)
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        for line in fh:
            fields = line.split()
            if fields[4] == target:
                for opt in fields[-1].split(","):
                    if opt.startswith("lowerdir="):
                        return opt.removeprefix("lowerdir=")
    raise RuntimeError(f"no overlay with a lowerdir mounted at {point}")


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main() -> int:
    default_images = (
        Path(os.environ.get("SANDFLEET_TEST_CACHE", "/var/tmp/sandfleet-test-cache")) / "images"
    )
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument(
        "--images-dir",
        type=Path,
        default=default_images,
        help=f"image store (default {default_images})",
    )
    ap.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    ap.add_argument(
        "--no-drop-caches",
        action="store_true",
        help="do not drop the page cache before the memory samples",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_containers.py must run as root (runc, mounts, cgroups)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    console = Console()
    ensure_demo_images(args.images_dir, console)
    # /var/tmp: on disk (upper layers must not be tmpfs, which would count as memory)
    state = Path(tempfile.mkdtemp(prefix="sandfleet-bench-", dir="/var/tmp"))
    bench = Bench(
        state, args.images_dir, QUICK if args.quick else FULL, drop_caches=not args.no_drop_caches
    )
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
        else:
            console.print(
                f"leftovers(state_dir) after {len(bench.ids)} sandboxes and runc containers: "
                "none — no sandbox process, mount, cgroup, runc container or state dir left"
            )
            if not ok:
                notable = [
                    line
                    for line in bench.dep.log().splitlines()
                    if any(w in line for w in ("WARNING", "ERROR", "refused", "Traceback"))
                ]
                console.print(
                    "the run failed; the deployment's log, warnings and errors:\n"
                    + "\n".join(notable[-40:])
                )
            if not mounts_under(state):
                shutil.rmtree(state, ignore_errors=True)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
