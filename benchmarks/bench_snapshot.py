"""Snapshot and fork(8) of a sandbox with 100 MiB of changes, end to end.

Starts ``sandfleet up`` (LocalDeployment) in a fresh directory under /var/tmp
with its own image store holding a busybox image (built as tests/conftest.py
builds it, in about a second). Nothing is asserted. For each shape of change:

- ``100 x 1 MiB``: 100 files of 1 MiB from /dev/urandom (incompressible);
- ``10,000 x 10 KiB``: 10,000 files of 10 KiB in 100 directories;

one source sandbox (default limits, 4 GiB writable layer) gets the changes,
then:

1. snapshot: ``sb.snapshot()`` (sync ``Client``), timed from the call to its
   answer, ``--runs`` times. Before each run one small file is rewritten, so
   every run packs, hashes and stores a new 100 MiB layer (an unchanged
   sandbox would give the same bytes, stored once). While each snapshot runs,
   a thread of this process reads the box's freezer state (v1
   ``freezer.state`` / v2 ``cgroup.freeze``) in a loop: "frozen" is how long
   it read frozen, i.e. how long the box's processes could not run.
2. fork(8): ``sb.fork(8)`` (its own snapshot + 8 creates in parallel), timed
   from the call to the 8 running handles, ``--forks`` times; then a first exec
   in each copy reading one changed file (``cat``) is timed; the copies are
   destroyed after each run, untimed.
3. for scale: ``client.create(image=<snapshot>)`` + first exec, and the same
   from the busybox image, 5 each, p50.

Run as root: ``python benchmarks/bench_snapshot.py [--runs N] [--forks N]``.
Everything created is destroyed, also on Ctrl-C or an error; the run ends with
``sandfleet.node.leaks.leftovers(state_dir)`` and removes its directory (the
snapshots' layers with it). Writes nothing but stdout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from rich.console import Console
from rich.table import Table

from sandfleet.backends.container.cgroups import detect_layout
from sandfleet.cli.local import LocalDeployment
from sandfleet.images import ImageStore, build_from_directory, busybox_tree
from sandfleet.node.leaks import leftovers
from sandfleet.sdk import Client, Sandbox

IMAGE = "bench/busybox:1"
FORKS = 8
SHAPES = {
    "100 x 1 MiB": "mkdir -p /data && for i in $(seq 100); do"
    " head -c 1048576 /dev/urandom > /data/f$i; done",
    "10,000 x 10 KiB": "for d in $(seq 100); do mkdir -p /data/d$d; for i in $(seq 100); do"
    " head -c 10240 /dev/urandom > /data/d$d/f$i; done; done",
}


def freezer_file(sandbox_id: str) -> Path:
    layout = detect_layout()
    v1 = [m for m, ctrls in layout.v1_mounts.items() if "freezer" in ctrls]
    if v1:
        return Path(v1[0]) / "sandfleet" / sandbox_id / "freezer.state"
    assert layout.v2_mount is not None
    return Path(layout.v2_mount) / "sandfleet" / sandbox_id / "cgroup.freeze"


@contextmanager
def frozen_time(path: Path) -> Iterator[list[float]]:
    """Yields [seconds]; on exit it holds how long ``path`` read frozen meanwhile."""
    out = [0.0]
    stop = threading.Event()

    def watch() -> None:
        since = None
        while not stop.is_set():
            try:
                state = path.read_text().strip()
            except OSError:
                state = ""
            now = time.perf_counter()
            if state in ("FROZEN", "FREEZING", "1"):
                since = now if since is None else since
            elif since is not None:
                out[0] += now - since
                since = None
        if since is not None:
            out[0] += time.perf_counter() - since

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        yield out
    finally:
        stop.set()
        t.join()


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def ms(values: list[float]) -> list[str]:
    """p50, min, max in ms (the columns of the table)."""
    if not values:
        return ["-", "-", "-"]
    return [
        f"{statistics.median(values) * 1000:.0f}",
        *(f"{f(values) * 1000:.0f}" for f in (min, max)),
    ]


def sh(sb: Sandbox, script: str, timeout_s: float = 600) -> str:
    r = sb.exec(["/bin/sh", "-c", script], timeout_s=timeout_s)
    if not r.ok:
        raise RuntimeError(f"{script!r} failed: {r}")
    return r.stdout_text


def bench_shape(
    client: Client, name: str, script: str, runs: int, forks: int, table: Table, console: Console
) -> None:
    with client.create(image=IMAGE) as src:
        t0 = time.perf_counter()
        sh(src, script)
        used = sh(src, "du -sk /data | cut -f1").strip()
        console.print(
            f"[dim]{name}: changes written in {time.perf_counter() - t0:.1f} s ({used} KiB)[/]"
        )
        snap_s: list[float] = []
        frozen_s: list[float] = []
        refs: list[str] = []
        fz = freezer_file(src.id)
        for i in range(runs):
            sh(src, f"echo {i} > /data/run")
            with frozen_time(fz) as frozen:
                snap_s.append(timed(lambda: refs.append(src.snapshot())))
            frozen_s.append(frozen[0])
        sizes = {m.ref: sum(x.size for x in m.layers[-1:]) for m in client.images()}
        layer_mib = sizes[refs[-1]] / 2**20
        fork_s: list[float] = []
        first_exec_s: list[float] = []
        for _ in range(forks):
            made: list[Sandbox] = []
            try:
                t0 = time.perf_counter()
                made = src.fork(FORKS)
                fork_s.append(time.perf_counter() - t0)
                for f in made:
                    first_exec_s.append(timed(lambda f=f: sh(f, "cat /data/run")))
            finally:
                for f in made:
                    f.destroy()
        from_snap: list[float] = []
        from_base: list[float] = []
        for image, out in ((refs[-1], from_snap), (IMAGE, from_base)):
            for _ in range(5):
                t0 = time.perf_counter()
                with client.create(image=image) as box:
                    sh(box, "true")
                    out.append(time.perf_counter() - t0)
    table.add_row(name, "snapshot", *ms(snap_s), str(runs))
    table.add_row(name, "  box frozen during it", *ms(frozen_s), str(runs))
    table.add_row(name, f"fork({FORKS})", *ms(fork_s), str(forks))
    table.add_row(name, "  then first exec in a copy", *ms(first_exec_s), str(len(first_exec_s)))
    table.add_row(name, "create + exec from the snapshot", *ms(from_snap), "5")
    table.add_row(name, "create + exec from busybox", *ms(from_base), "5")
    console.print(f"[dim]{name}: diff layer {layer_mib:.1f} MiB (EROFS, uncompressed)[/]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="snapshots per shape (default 5)")
    parser.add_argument("--forks", type=int, default=3, help="fork(8) runs per shape (default 3)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (runc, mounts, cgroups)")
    console = Console()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    root = Path(tempfile.mkdtemp(prefix="sandfleet-bench-snapshot-", dir="/var/tmp"))
    try:
        tree = root / "tree"
        tree.mkdir()
        busybox_tree(tree)
        build_from_directory(ImageStore(root / "images"), IMAGE, tree, log=lambda _: None)
        table = Table("changes", "what", "p50 ms", "min", "max", "n", title="snapshot and fork")
        t0 = time.perf_counter()
        with (
            LocalDeployment(root / "state", root / "images") as dep,
            Client(dep.url, timeout_s=600) as client,
        ):
            for name, script in SHAPES.items():
                bench_shape(client, name, script, args.runs, args.forks, table, console)
        console.print(table)
        left = leftovers(root / "state")
        console.print(f"wall {time.perf_counter() - t0:.0f} s; leftovers: {left or 'none'}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
