"""Streamed exec output, measured end to end on a real local deployment.

Starts ``sandfleet up`` (LocalDeployment) in a fresh state directory under
/var/tmp and uses the Debian base image ``sandfleet/bookworm-python:1`` (built by
``ensure_demo_images`` if missing). Nothing is asserted. What is measured, and how:

1. Streaming latency: one sandbox runs ``mkfifo /tmp/<name> && exec cat /tmp/<name>``
   as a streamed exec. A thread of this process opens that FIFO through the
   sandbox's rootfs on the host (``<state>/nodes/<node>/container/sandboxes/<id>/
   rootfs/tmp/<name>``), writes one numbered line, and records
   ``time.perf_counter()`` just before the write; the consumer records it when the
   line reaches it. Latency = receipt - write, same clock, same process. The next
   line is written only after the previous one arrived, plus a 2 ms gap (so
   lines are never coalesced). The first 20 lines of each path are warm-up.
   Paths: the sync ``Client`` and the ``AsyncClient``, each with ``exec(...,
   on_stdout=cb)`` and with ``exec_stream``; for the layer split, the node
   agent's ``POST /v1/sandboxes/{id}/exec/stream`` directly (no control plane)
   and ``AgentClient.exec(on_stdout=...)`` on the box's socket (no HTTP).
2. Throughput: ``head -c 1073741824 /dev/zero`` (1 GiB to stdout) through
   ``exec_stream(max_output_bytes=None)`` (no cap), sync and async, best of 3
   by wall time; the bytes are counted, not kept. Also the same command through
   the plain ``exec`` with the default cap (16 MiB kept: 8 MiB head, 8 MiB
   tail), and the lower layers as in 1. For each run: the CPU seconds of this
   process (``time.process_time``), of the control plane and node agent
   processes (/proc/<pid>/stat utime+stime) and of the box's cgroup (agent +
   ``head``; cpuacct.usage or cpu.stat).

Run as root: ``python benchmarks/bench_streaming.py [--images-dir DIR] [--quick]``.
Everything created is destroyed, also on Ctrl-C or an error, and the run ends
with ``sandfleet.node.leaks.leftovers(state_dir)``. Writes nothing but stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import resource
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import httpx
from rich.console import Console
from rich.table import Table

from sandfleet.cli.demo import ensure_demo_images
from sandfleet.cli.local import LocalDeployment
from sandfleet.guest.client import AgentClient
from sandfleet.node.leaks import leftovers
from sandfleet.node.mounts import mounts_under
from sandfleet.sdk import AsyncClient, AsyncSandbox, Client, Sandbox, _core
from sandfleet.wire.models import ExecRequest

IMAGE = "sandfleet/bookworm-python:1"
MEMORY_MB = 256
GIB = 1 << 30
MIB = 1 << 20
HEAD = ["head", "-c", str(GIB), "/dev/zero"]
WARMUP = 20
GAP_S = 0.002
EXEC_TIMEOUT_S = 600.0
TICK = os.sysconf("SC_CLK_TCK")

OnData = Callable[[bytes], None]


@dataclass(frozen=True)
class Counts:
    samples: int  # latency samples per path (after WARMUP)
    runs: int  # 1 GiB runs per path (best is reported)


FULL = Counts(samples=300, runs=3)
QUICK = Counts(samples=50, runs=1)


def pct(samples: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100) of ``samples``."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def proc_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # fields 14 and 15 of stat(5)


def cgroup_cpu_s(sandbox_id: str) -> float:
    """CPU seconds charged to the box's cgroup (v1 cpuacct.usage or v2 cpu.stat)."""
    for base in ("/sys/fs/cgroup/cpuacct", "/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup"):
        d = Path(base) / "sandfleet" / sandbox_id
        with contextlib.suppress(OSError):
            return int((d / "cpuacct.usage").read_text()) / 1e9
        with contextlib.suppress(OSError):
            for line in (d / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
    return math.nan


@dataclass
class Run:
    """One 1 GiB run."""

    wall: float
    nbytes: int  # bytes delivered to the caller
    client_cpu: float
    server_cpu: float  # control plane + node agent processes
    box_cpu: float  # the box's cgroup


class FifoWriter(threading.Thread):
    """Writes numbered lines into a FIFO of the box through its rootfs; timestamps them."""

    def __init__(self, path: Path, count: int) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.count = count
        self.sent: dict[int, float] = {}
        self.latencies: list[float] = []
        self.arrived = threading.Event()
        self.error: BaseException | None = None
        self._buf = bytearray()

    def on_data(self, data: bytes) -> None:
        """The consumer's callback: match the lines that arrived to their write times."""
        now = time.perf_counter()
        self._buf += data
        while (nl := self._buf.find(b"\n")) >= 0:
            seq = int(self._buf[:nl])
            del self._buf[: nl + 1]
            self.latencies.append(now - self.sent[seq])
        self.arrived.set()

    def run(self) -> None:
        try:
            deadline = time.monotonic() + 30
            while not self.path.exists():  # mkfifo inside the box has not run yet
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.path} did not appear on the host")
                time.sleep(0.005)
            fd = os.open(self.path, os.O_WRONLY)  # blocks until cat opens it
            try:
                for i in range(self.count):
                    self.arrived.clear()
                    line = f"{i}\n".encode()
                    self.sent[i] = time.perf_counter()
                    os.write(fd, line)
                    if not self.arrived.wait(10):
                        raise RuntimeError(f"line {i} did not arrive within 10 s")
                    time.sleep(GAP_S)
            finally:
                os.close(fd)  # cat sees EOF and the exec ends
        except BaseException as exc:  # reported by the caller
            self.error = exc


class Bench:
    def __init__(self, state: Path, images: Path, counts: Counts) -> None:
        self.state = state
        self.images = images
        self.counts = counts
        console = Console()
        self.console = console if console.is_terminal else Console(width=170)
        self.dep = LocalDeployment(state, images)
        self.node_dir = state / "nodes" / self.dep.node_id / "container"
        self.ids: set[str] = set()
        self.rows: list[tuple[str, str, str, str]] = []

    # ------------------------------------------------------------------ plumbing

    def node_http(self) -> httpx.Client:
        token = (self.state / "node-token").read_text().strip()  # cluster token of `up`
        return httpx.Client(
            base_url=f"http://127.0.0.1:{self.dep.node_port}",
            headers={"Authorization": f"Bearer {token}"},
            timeout=EXEC_TIMEOUT_S + 30,
        )

    def server_cpu(self) -> float:
        needle = f"--state-dir\0{self.state}\0".encode()
        total = 0.0
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if needle in (entry / "cmdline").read_bytes():
                        total += proc_cpu_s(int(entry.name))
        return total

    def agent(self, sandbox_id: str) -> AgentClient:
        return AgentClient(self.node_dir / "sandboxes" / sandbox_id / "agent.sock")

    def node_stream(self, sandbox_id: str, req: ExecRequest, on_data: OnData) -> None:
        """POST .../exec/stream on the node agent directly; stdout chunks to ``on_data``."""
        with (
            self.node_http() as h,
            h.stream(
                "POST",
                f"/v1/sandboxes/{sandbox_id}/exec/stream",
                content=req.model_dump_json().encode(),
                headers={"Content-Type": "application/json"},
            ) as resp,
        ):
            resp.raise_for_status()
            lines = _core.Lines()  # the SDK's own NDJSON splitting and event decoding
            for chunk in resp.iter_raw():
                for line in lines.feed(chunk):
                    event = _core.parse_exec_event(line)
                    if event.type == "stdout":
                        on_data(event.data)
            lines.end()

    def table(self, title: str, *columns: str) -> Table:
        return Table(*columns, title=title, title_justify="left")

    # ------------------------------------------------------------------ 1. latency

    def fifo_cmd(self) -> tuple[str, str]:
        name = f"lat-{secrets.token_hex(4)}"
        return name, f"mkfifo /tmp/{name} && exec cat /tmp/{name}"

    def writer(self, sandbox_id: str, name: str) -> FifoWriter:
        path = self.node_dir / "sandboxes" / sandbox_id / "rootfs" / "tmp" / name
        w = FifoWriter(path, WARMUP + self.counts.samples)
        w.start()
        return w

    def sync_latency(self, sb: Sandbox, how: str) -> list[float]:
        name, cmd = self.fifo_cmd()
        w = self.writer(sb.id, name)
        if how == "on_stdout":
            sb.exec(cmd, on_stdout=w.on_data, timeout_s=EXEC_TIMEOUT_S)
        elif how == "exec_stream":
            for ev in sb.exec_stream(cmd, timeout_s=EXEC_TIMEOUT_S):
                if ev.type == "stdout":
                    w.on_data(ev.data)
        else:  # node API directly
            self.node_stream(sb.id, ExecRequest(cmd=cmd, timeout_s=EXEC_TIMEOUT_S), w.on_data)
        return self.finish(w)

    async def async_latency(self, sb: AsyncSandbox, how: str) -> list[float]:
        name, cmd = self.fifo_cmd()
        w = self.writer(sb.id, name)
        if how == "on_stdout":
            await sb.exec(cmd, on_stdout=w.on_data, timeout_s=EXEC_TIMEOUT_S)
        elif how == "exec_stream":
            async for ev in sb.exec_stream(cmd, timeout_s=EXEC_TIMEOUT_S):
                if ev.type == "stdout":
                    w.on_data(ev.data)
        else:  # AgentClient on the box's socket
            req = ExecRequest(cmd=cmd, timeout_s=EXEC_TIMEOUT_S)
            await self.agent(sb.id).exec(req, on_stdout=w.on_data, keep_output=False)
        return self.finish(w)

    @staticmethod
    def finish(w: FifoWriter) -> list[float]:
        w.join(30)
        if w.error is not None:
            raise RuntimeError(f"FIFO writer failed: {w.error!r}") from w.error
        return w.latencies[WARMUP:]

    async def latency(self, client: AsyncClient, sync: Client) -> None:
        asb = await client.create(image=IMAGE, memory_mb=MEMORY_MB)
        self.ids.add(asb.id)
        ssb = sync.get(asb.id)
        results: dict[str, list[float]] = {}
        paths = [  # label, sync (in a thread) or async, how
            ("sync Client, exec(on_stdout=cb)", True, "on_stdout"),
            ("sync Client, exec_stream", True, "exec_stream"),
            ("AsyncClient, exec(on_stdout=cb)", False, "on_stdout"),
            ("AsyncClient, exec_stream", False, "exec_stream"),
            ("node HTTP exec/stream directly (httpx, sync)", True, "node"),
            ("AgentClient on the box's socket (no HTTP)", False, "agent"),
        ]
        for label, is_sync, how in paths:
            if is_sync:
                results[label] = await asyncio.to_thread(self.sync_latency, ssb, how)
            else:
                results[label] = await self.async_latency(asb, how)
        await asb.destroy()
        n = self.counts.samples
        t = self.table(
            f"1. streaming latency: line written into a FIFO in the box → consumer, {n} samples",
            "path",
            "p50",
            "p90",
            "p99",
            "max",
        )
        for label, xs in results.items():
            t.add_row(label, ms(pct(xs, 50)), ms(pct(xs, 90)), ms(pct(xs, 99)), ms(max(xs)))
            self.row(
                f"streaming latency p50 / p99, {label}",
                f"{ms(pct(xs, 50))} / {ms(pct(xs, 99))}",
                "—",
                f"{n} lines (after {WARMUP} warm-up): host write into <rootfs>/tmp/<fifo>"
                " → consumer",
            )
        self.console.print(t)

    # ------------------------------------------------------------------ 2. throughput

    def sync_gib(self, sb: Sandbox, how: str) -> int:
        n = 0
        if how == "stream":
            for ev in sb.exec_stream(HEAD, max_output_bytes=None, timeout_s=EXEC_TIMEOUT_S):
                if ev.type == "stdout":
                    n += len(ev.data)
                elif ev.type == "result" and (ev.result is None or not ev.result.ok):
                    raise RuntimeError(f"head failed: {ev.result}")
            return n
        if how == "capped":
            r = sb.exec(HEAD, timeout_s=EXEC_TIMEOUT_S)
            if not r.ok:
                raise RuntimeError(f"head failed: {r}")
            return len(r.stdout)

        def count(data: bytes) -> None:
            nonlocal n
            n += len(data)

        req = ExecRequest(cmd=HEAD, max_output_bytes=None, timeout_s=EXEC_TIMEOUT_S)
        self.node_stream(sb.id, req, count)
        return n

    async def async_gib(self, sb: AsyncSandbox, how: str) -> int:
        n = 0
        if how == "stream":
            async for ev in sb.exec_stream(HEAD, max_output_bytes=None, timeout_s=EXEC_TIMEOUT_S):
                if ev.type == "stdout":
                    n += len(ev.data)
                elif ev.type == "result" and (ev.result is None or not ev.result.ok):
                    raise RuntimeError(f"head failed: {ev.result}")
            return n
        if how == "capped":
            r = await sb.exec(HEAD, timeout_s=EXEC_TIMEOUT_S)
            if not r.ok:
                raise RuntimeError(f"head failed: {r}")
            return len(r.stdout)

        def count(data: bytes) -> None:
            nonlocal n
            n += len(data)

        req = ExecRequest(cmd=HEAD, max_output_bytes=None, timeout_s=EXEC_TIMEOUT_S)
        r = await self.agent(sb.id).exec(req, on_stdout=count, keep_output=False)
        if not r.ok:
            raise RuntimeError(f"head failed: {r}")
        return n

    async def timed(self, sandbox_id: str, fn: Callable[[], Awaitable[int]]) -> Run:
        c0, s0, b0 = time.process_time(), self.server_cpu(), cgroup_cpu_s(sandbox_id)
        t0 = time.perf_counter()
        n = await fn()
        wall = time.perf_counter() - t0
        return Run(
            wall=wall,
            nbytes=n,
            client_cpu=time.process_time() - c0,
            server_cpu=self.server_cpu() - s0,
            box_cpu=cgroup_cpu_s(sandbox_id) - b0,
        )

    async def throughput(self, client: AsyncClient, sync: Client) -> None:
        asb = await client.create(image=IMAGE, memory_mb=MEMORY_MB)
        self.ids.add(asb.id)
        ssb = sync.get(asb.id)
        # in-box reference: the pipe alone, no sandfleet in the data path
        ref = await asb.exec(["sh", "-c", f"head -c {GIB} /dev/zero | cat > /dev/null"])
        paths = [  # label, sync (in a thread) or async, how
            ("sync Client, exec_stream(max_output_bytes=None)", True, "stream"),
            ("AsyncClient, exec_stream(max_output_bytes=None)", False, "stream"),
            ("sync Client, exec (default 16 MiB cap)", True, "capped"),
            ("AsyncClient, exec (default 16 MiB cap)", False, "capped"),
            ("node HTTP exec/stream directly (httpx, sync, no cap)", True, "node"),
            ("AgentClient on the box's socket (no HTTP, no cap)", False, "agent"),
        ]

        def one(is_sync: bool, how: str) -> Callable[[], Awaitable[int]]:
            if is_sync:
                return lambda: asyncio.to_thread(self.sync_gib, ssb, how)
            return lambda: self.async_gib(asb, how)

        best: dict[str, Run] = {}
        walls: dict[str, list[float]] = {}
        for label, is_sync, how in paths:
            fn = one(is_sync, how)
            runs = [await self.timed(asb.id, fn) for _ in range(self.counts.runs)]
            best[label] = min(runs, key=lambda r: r.wall)
            walls[label] = [r.wall for r in runs]
        await asb.destroy()
        t = self.table(
            f"2. 1 GiB of stdout (`head -c {GIB} /dev/zero`), best of {self.counts.runs} by wall",
            "path",
            "MiB/s",
            "wall (all runs)",
            "bytes received",
            "client CPU s/GiB",
            "CP + node CPU s/GiB",
            "box cgroup CPU s/GiB",
        )
        t.add_row(
            "in-box reference: head | cat > /dev/null",
            f"{GIB / MIB / ref.duration_s:.0f}",
            f"{ref.duration_s:.2f} s (agent duration_s)",
            "—",
            "—",
            "—",
            "—",
        )
        for label, r in best.items():
            t.add_row(
                label,
                f"{GIB / MIB / r.wall:.0f}",
                ", ".join(f"{w:.2f}" for w in walls[label]) + " s",
                f"{r.nbytes / MIB:.0f} MiB",
                f"{r.client_cpu:.2f}",
                f"{r.server_cpu:.2f}",
                f"{r.box_cpu:.2f}",
            )
            self.row(
                f"1 GiB stdout, {label}",
                f"{GIB / MIB / r.wall:.0f} MiB/s; client CPU {r.client_cpu:.2f} s/GiB",
                "—",
                f"best of {self.counts.runs} (wall {r.wall:.2f} s); CP + node CPU "
                f"{r.server_cpu:.2f} s, box {r.box_cpu:.2f} s; received {r.nbytes / MIB:.0f} MiB",
            )
        self.console.print(t)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self.console.print(f"peak RSS of this client process over the run: {peak:.0f} MiB")
        self.row(
            "in-box pipe reference (no sandfleet in the data path)",
            f"{GIB / MIB / ref.duration_s:.0f} MiB/s",
            "—",
            f"`head -c 1G /dev/zero | cat > /dev/null` in the box, agent duration_s "
            f"{ref.duration_s:.2f} s",
        )

    def row(self, what: str, value: str, goal: str, method: str) -> None:
        self.rows.append((what, value, goal, method))

    # ------------------------------------------------------------------ run

    async def _main(self) -> None:
        async with AsyncClient(self.dep.url, timeout_s=60) as client:
            with Client(self.dep.url, timeout_s=60) as sync:
                warm = await client.create(image=IMAGE, memory_mb=MEMORY_MB)  # layers mounted
                self.ids.add(warm.id)
                await warm.exec(["true"])
                await warm.destroy()
                await self.latency(client, sync)
                await self.throughput(client, sync)

    def run(self) -> None:
        self.console.print(
            f"sandfleet streaming benchmark: {IMAGE}, {os.cpu_count()} cores, "
            f"loadavg {loadavg()}, state {self.state}"
        )
        self.dep.start()
        asyncio.run(self._main())
        t = self.table("summary", "what", "value", "goal", "method")
        for r in self.rows:
            t.add_row(*r)
        self.console.print(t)
        self.console.print(f"loadavg at the end: {loadavg()}")

    def cleanup(self) -> list[str]:
        with contextlib.suppress(Exception), Client(self.dep.url, timeout_s=30) as c:
            for info in c.list():  # our own control plane: every sandbox listed is ours
                self.ids.add(info.id)
                with contextlib.suppress(Exception):
                    c.get(info.id).destroy()
        self.dep.stop()
        return leftovers(self.state)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main() -> int:
    default_images = (
        Path(os.environ.get("SANDFLEET_TEST_CACHE", "/var/tmp/sandfleet-test-cache")) / "images"
    )
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--images-dir", type=Path, default=default_images)
    ap.add_argument("--quick", action="store_true", help="50 samples, 1 run per path")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print(
            "bench_streaming.py must run as root (it writes into a box's rootfs)", file=sys.stderr
        )
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    console = Console()
    ensure_demo_images(args.images_dir, console)
    state = Path(tempfile.mkdtemp(prefix="sandfleet-bench-stream-", dir="/var/tmp"))
    bench = Bench(state, args.images_dir, QUICK if args.quick else FULL)
    left: list[str] = []
    try:
        bench.run()
    finally:
        left = bench.cleanup()
        if left:
            console.print("[red]left behind:[/]\n  " + "\n  ".join(left))
            console.print(f"state dir kept for inspection: {state}")
        else:
            console.print(f"leftovers(state_dir) after {len(bench.ids)} sandboxes: none")
            if not mounts_under(state):
                shutil.rmtree(state, ignore_errors=True)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
