"""The trajectory log: fast-forward of 1,000 logged steps, and what logging costs per call.

Starts ``sandfleet up`` (LocalDeployment) in a fresh state directory under
/var/tmp with a busybox image built there as tests/conftest.py builds it
(needs ``busybox-static``). One sandbox runs ``--steps`` (default 1,000)
logged execs ``["echo", "<i>"]`` through a ``create()`` handle; then:

1. Fast-forward through the SDK: ``client.attach(id, resume_from_log=True)``
   (which fetches the log once) and the same ``--steps`` execs re-issued, each
   answered from the log (checked: all ``replayed``); wall time from before the
   attach to the last result, sync ``Client`` and ``AsyncClient``, best and
   median of ``--rounds``. Split: the attach alone (get + log fetch + parse).
2. The node answering the re-issued calls itself (no fetched log): the same
   execs as ``POST /v1/sandboxes/{id}/exec`` with the step header, one request
   each, through the control plane (httpx, keep-alive).
3. Cost of logging per call: ``--calls`` (default 300) execs of ``true`` and
   as many 16-byte file writes through a logging handle (``create``) and a
   non-logging one (``get``) on the same sandbox, interleaved one by one, after
   20 warm-up calls each; p50 / p99. Logging = digest, one JSON line appended
   and fdatasync'd (in a worker thread) before the answer.

Prints rich tables; nothing is asserted. Everything is destroyed (also on an
error) and the run ends with ``sandfleet.node.leaks.leftovers(state_dir)``.
Run as root: ``python benchmarks/bench_trajectory.py [--steps N] [--rounds N] [--calls N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from sandfleet.cli.local import LocalDeployment
from sandfleet.images import ImageStore, build_busybox
from sandfleet.node.leaks import leftovers
from sandfleet.sdk import AsyncClient, Client
from sandfleet.wire.models import REPLAYED_HEADER, STEP_HEADER

IMAGE = "bench/busybox:1"


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def sync_fast_forward(url: str, sandbox_id: str, steps: int) -> tuple[float, float]:
    """(attach seconds, total seconds) of one fast-forward through the sync SDK."""
    with Client(url) as client:
        client.nodes()  # connection up: the round is timed from the attach
        t0 = time.perf_counter()
        sb = client.attach(sandbox_id, resume_from_log=True)
        t1 = time.perf_counter()
        results = [sb.exec(["echo", str(i)]) for i in range(steps)]
        t2 = time.perf_counter()
    assert all(r.replayed and r.stdout == f"{i}\n".encode() for i, r in enumerate(results))
    return t1 - t0, t2 - t0


async def async_fast_forward(url: str, sandbox_id: str, steps: int) -> tuple[float, float]:
    async with AsyncClient(url) as client:
        await client.nodes()
        t0 = time.perf_counter()
        sb = await client.attach(sandbox_id, resume_from_log=True)
        t1 = time.perf_counter()
        results = [await sb.exec(["echo", str(i)]) for i in range(steps)]
        t2 = time.perf_counter()
    assert all(r.replayed and r.stdout == f"{i}\n".encode() for i, r in enumerate(results))
    return t1 - t0, t2 - t0


def node_replays(url: str, sandbox_id: str, steps: int) -> float:
    """Seconds for the node to answer ``steps`` re-issued execs, one request each."""
    with httpx.Client(base_url=url, timeout=30) as http:
        http.get("/v1/nodes")
        t0 = time.perf_counter()
        for i in range(steps):
            r = http.post(
                f"/v1/sandboxes/{sandbox_id}/exec",
                json={"cmd": ["echo", str(i)]},
                headers={STEP_HEADER: str(i)},
            )
            assert r.headers.get(REPLAYED_HEADER) == "1", r.text
        return time.perf_counter() - t0


def logging_cost(client: Client, sandbox_id: str, calls: int) -> dict[str, list[float]]:
    """Per-call seconds of exec and write, logged and not, interleaved."""
    logged = client.attach(sandbox_id)
    plain = client.get(sandbox_id)
    out: dict[str, list[float]] = {k: [] for k in ("exec+log", "exec", "write+log", "write")}
    for i in range(20 + calls):
        for key, sb in (("exec+log", logged), ("exec", plain)):
            t0 = time.perf_counter()
            sb.exec(["true"])
            if i >= 20:
                out[key].append(time.perf_counter() - t0)
        for key, sb in (("write+log", logged), ("write", plain)):
            t0 = time.perf_counter()
            sb.files.write("/tmp/w", b"0123456789abcdef")
            if i >= 20:
                out[key].append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    console = Console()
    console = console if console.is_terminal else Console(width=140)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    console.print(f"trajectory log, {os.cpu_count()} cores, loadavg {load}")
    root = Path(tempfile.mkdtemp(prefix="bench-trajectory-", dir="/var/tmp"))
    state = root / "state"
    try:
        build_busybox(ImageStore(root / "images"), IMAGE, log=lambda _: None)
        with LocalDeployment(state, root / "images") as dep, Client(dep.url) as client:
            sb = client.create(image=IMAGE, memory_mb=128)
            try:
                t0 = time.perf_counter()
                for i in range(args.steps):
                    sb.exec(["echo", str(i)])
                record = time.perf_counter() - t0
                log_bytes = sum(p.stat().st_size for p in state.glob("nodes/*/boxes/*.log"))

                sync_runs = [
                    sync_fast_forward(dep.url, sb.id, args.steps) for _ in range(args.rounds)
                ]
                async_runs = [
                    asyncio.run(async_fast_forward(dep.url, sb.id, args.steps))
                    for _ in range(args.rounds)
                ]
                node = node_replays(dep.url, sb.id, args.steps)
                cost = logging_cost(client, sb.id, args.calls)
            finally:
                sb.destroy()

        table = Table(
            "what", "value", "goal", "method", title="trajectory log", title_justify="left"
        )
        for name, runs in (("sync Client", sync_runs), ("AsyncClient", async_runs)):
            totals = [t for _, t in runs]
            attaches = [a for a, _ in runs]
            met = "met" if min(totals) <= 0.1 else "missed"
            table.add_row(
                f"fast-forward of {args.steps} steps, {name}, best / median",
                f"[bold]{ms(min(totals))}[/] / {ms(statistics.median(totals))}",
                f"≤ 100 ms ({met})",
                f"attach(resume_from_log=True) + {args.steps} x exec(['echo', i]), all replayed;"
                f" {args.rounds} rounds",
            )
            table.add_row(
                f"  of which attach (get + fetch and parse the log), {name}, median",
                ms(statistics.median(attaches)),
                "—",
                f"log of {args.steps} entries, {log_bytes / 1024:.0f} KiB on the node",
            )
            per = [(t - a) / args.steps for a, t in runs]
            table.add_row(
                f"  per re-issued call, {name}, median",
                f"{statistics.median(per) * 1e6:.1f} µs",
                "—",
                "digest checked against the fetched log; no request",
            )
        table.add_row(
            f"node answering {args.steps} re-issued execs itself",
            ms(node),
            "—",
            "one POST …/exec with the step header each, through the control plane;"
            f" {node / args.steps * 1e3:.2f} ms per call",
        )
        table.add_row(
            f"recording the {args.steps} steps (logged exec of echo)",
            ms(record),
            "—",
            f"{record / args.steps * 1e3:.2f} ms per call",
        )
        for op in ("exec", "write"):
            base, logged = cost[op], cost[f"{op}+log"]
            extra = statistics.median(logged) - statistics.median(base)
            table.add_row(
                f"{op} p50 / p99, logged vs not",
                f"{ms(statistics.median(logged))} / {ms(pct(logged, 0.99))} vs"
                f" {ms(statistics.median(base))} / {ms(pct(base, 0.99))}",
                "—",
                f"{args.calls} each, interleaved; logging adds {extra * 1e3:.2f} ms at p50",
            )
        console.print(table)
    finally:
        left = leftovers(state) if state.exists() else []
        if not left:  # never remove a tree that still holds mounts
            shutil.rmtree(root, ignore_errors=True)
    console.print(f"leftovers: {'; '.join(left) if left else 'none'}")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
