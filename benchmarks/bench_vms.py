"""VM sandboxes (kinds ``microvm`` and ``vm``), measured end to end on a real local deployment.

Starts ``sandfleet up`` (LocalDeployment) twice, one after the other, each in a
fresh state directory under /var/tmp: first with ``SANDFLEET_VM_TEMPLATES=0``
(every create boots the guest), then with templates on (the default: the first
create of a (kind, image, size) key boots the guest and saves it as a template,
every create restores it). The image is a small busybox image
``bench/busybox:1`` built into ``--images-dir`` if missing (as tests/conftest.py
does), or with ``--debian`` the demo's ``sandfleet/bookworm-python:1``. Every
sandbox has memory_mb=128, cpu=1 and the SDK's default disk. The accelerator
(KVM or TCG) is printed from the node's capabilities. Every time is wall clock
from ``time.perf_counter`` around a sync ``Client`` call (unless said
otherwise); nothing is asserted. What is measured, per kind, and how:

1. Cold boot to agent ready (templates off): N sequential creates; create →
   create returned (the node returns once the guest's agent answered) and
   create → first exec ``true`` completed; p50, min, max. Each sandbox is
   destroyed after it is measured (untimed). The last one is kept idle for 3 s
   first and its QEMU's RSS/PSS read (the comparison for 6.).
2. Template build (templates on, fresh state directory, so no template yet):
   the first create of the key (boot + save + restore) → returned, and → first
   exec done; the template's RAM file and device state sizes on disk.
3. Create from the template → first exec completed: N sequential creates,
   p50/p90 (destroy after each, untimed); then N creates at once (AsyncClient,
   asyncio.gather): wall time until all first execs are done, and the p50/max
   of the individual create → first exec.
4. Exec round trip of ``true`` on one sandbox: N sequential sync
   ``Client.exec(["true"])`` after 10 warm-up calls, p50/p90; the agent's own
   ``ExecResult.duration_s`` of the same calls (fork/exec/wait in the guest);
   and the same through ``AgentClient`` on the sandbox's mux socket
   (``<sandbox dir>/agent.sock``: virtio-serial to the guest, no HTTP), which
   splits the transport into HTTP (SDK → control plane → node) and the VM's
   channel.
5. Pause and resume on that sandbox, N cycles: time of ``sb.pause()`` (the
   guest's RAM and device state saved to ``<sandbox dir>/paused.state``, QEMU
   killed), the size of paused.state (apparent and allocated), ``sb.resume()``
   and the first exec after it; then N more cycles where the exec itself
   resumes the paused sandbox (pause, then exec timed). p50 and max.
6. Host memory per idle VM: N sandboxes created from the template (+ first
   exec), left idle 5 s; each QEMU process found by its command line
   (``-pidfile <sandbox dir>/pid``, as sandfleet.node.leaks does) and its
   Rss, Pss and Anonymous read from /proc/<pid>/smaps_rollup; mean and total.
   Clones map the template's RAM file copy-on-write (MAP_PRIVATE): pages the
   guest only read are shared with the page cache and the other clones, so
   PSS < RSS. Also the idle CPU of those QEMUs (utime + stime over 5 s) and,
   from 1., the RSS of a cold-booted VM.

Run as root: ``python benchmarks/bench_vms.py [--quick] [--kinds microvm,vm]
[--images-dir DIR] [--debian]``. Everything created is destroyed, also on Ctrl-C,
SIGTERM or an error; each deployment ends with
``sandfleet.node.leaks.leftovers(state_dir)``. Writes nothing but stdout (and the
busybox image into the images directory the first time).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from rich.console import Console
from rich.table import Table

from sandfleet.cli.local import LocalDeployment
from sandfleet.guest.client import AgentClient
from sandfleet.images import ImageStore, build_from_directory, busybox_tree
from sandfleet.node.leaks import leftovers
from sandfleet.sdk import AsyncClient, AsyncSandbox, Client, Sandbox
from sandfleet.wire.errors import ResourceExhausted, Unavailable
from sandfleet.wire.models import ExecRequest

BUSYBOX = "bench/busybox:1"
DEBIAN = "sandfleet/bookworm-python:1"
KINDS = ("microvm", "vm")
MEMORY_MB = 128
TRUE = ["true"]
CREATE_ATTEMPTS = 5
TIMEOUT_S = 600.0  # TCG on a loaded 2-core host: a cold boot can take a while
GOAL_CREATE_S = 1.5  # microvm: create from snapshot → first exec
GOAL_EXEC_S = 0.020  # microvm: exec round trip


@dataclass(frozen=True)
class Counts:
    """How many of each thing one run measures."""

    cold: int  # cold boots per kind
    seq: int  # sequential creates from the template
    burst: int  # creates at once from the template
    execs: int  # exec round trips
    cycles: int  # pause/resume cycles (and as many pause/exec cycles)
    idle: int  # idle VMs for the memory figures


FULL = Counts(cold=5, seq=10, burst=8, execs=100, cycles=5, idle=8)
QUICK = Counts(cold=2, seq=4, burst=4, execs=30, cycles=2, idle=4)


# ---------------------------------------------------------------------- helpers


def pct(samples: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100) of ``samples``."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def sec(seconds: float) -> str:
    return f"{seconds:.2f} s"


def mib(kib: float) -> str:
    return f"{kib / 1024:.1f} MiB"


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def qemu_pids(box_dir: Path) -> list[int]:
    """QEMU processes started with ``-pidfile <box_dir>/pid`` (cf. leaks._qemu_pids)."""
    needle = b"\0-pidfile\0" + str(box_dir / "pid").encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (entry / "cmdline").read_bytes() + b"\0":
                    found.append(int(entry.name))
    return found


def smaps_rollup(pid: int) -> dict[str, int]:
    """/proc/<pid>/smaps_rollup in KiB (empty if the process is gone)."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0])
    return out


def cpu_ticks(pid: int) -> int:
    """utime + stime of ``pid`` in clock ticks (0 if gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = stat.rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5)


def idle_cpu_percent(pids: list[int], window_s: float = 5.0) -> list[float]:
    """CPU used by each of ``pids`` over ``window_s``, in % of one core."""
    hz = os.sysconf("SC_CLK_TCK")
    before = [cpu_ticks(p) for p in pids]
    time.sleep(window_s)
    after = [cpu_ticks(p) for p in pids]
    return [(a - b) / hz / window_s * 100 for a, b in zip(after, before, strict=True)]


def file_sizes(path: Path) -> tuple[int, int]:
    """(apparent, allocated) bytes of ``path``; (0, 0) if it does not exist."""
    try:
        st = path.stat()
    except OSError:
        return 0, 0
    return st.st_size, st.st_blocks * 512


def ensure_busybox(images_dir: Path, console: Console) -> None:
    """Build ``bench/busybox:1`` into ``images_dir`` unless it is there (about a second)."""
    store = ImageStore(images_dir)
    if store.has_image(BUSYBOX):
        return
    console.print(f"building {BUSYBOX} into {images_dir}")
    with tempfile.TemporaryDirectory(prefix="busybox-tree-", dir="/var/tmp") as tree:
        busybox_tree(Path(tree))
        build_from_directory(store, BUSYBOX, Path(tree))


@dataclass
class Row:
    """One line of the summary: a value per kind."""

    what: str
    goal: str
    method: str
    values: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------- the benchmark


class Bench:
    """One run: the deployments, the sandboxes made in them, and the figures measured."""

    def __init__(
        self, work: Path, images: Path, image: str, kinds: list[str], counts: Counts
    ) -> None:
        self.work = work
        self.images = images
        self.image = image
        self.kinds = kinds
        self.counts = counts
        console = Console()
        # piped output: wide enough for the summary table instead of rich's 80 columns
        self.console = console if console.is_terminal else Console(width=180)
        self.deps: list[LocalDeployment] = []  # every deployment started (leak-checked)
        self.created = 0
        self.retries: list[str] = []
        self.rows: dict[str, Row] = {}
        self.accel: dict[str, str] = {}
        self.cold_rss: dict[str, dict[str, int]] = {}  # smaps_rollup of a cold-booted VM
        self.cold_create_p50: dict[str, float] = {}
        self.offered: list[str] = list(kinds)

    # ------------------------------------------------------------------ plumbing

    def row(self, key: str, kind: str, value: str, goal: str = "—", method: str = "") -> None:
        r = self.rows.setdefault(key, Row(key, goal, method))
        r.values[kind] = value
        if method:
            r.method = method
        if goal != "—":
            r.goal = goal

    def table(self, title: str, *columns: str) -> Table:
        return Table(*columns, title=title, title_justify="left")

    @contextlib.contextmanager
    def deployment(self, name: str, env: dict[str, str]) -> Iterator[LocalDeployment]:
        """A started deployment in ``work/name``; on exit its sandboxes are destroyed,
        it is stopped and its leftovers are printed."""
        dep = LocalDeployment(self.work / name / "state", self.images, env=env)
        self.deps.append(dep)
        dep.start()
        try:
            yield dep
        finally:
            self.stop(dep)

    def stop(self, dep: LocalDeployment) -> None:
        with contextlib.suppress(Exception), Client(dep.url, timeout_s=120) as c:
            for info in c.list():  # our own control plane: every sandbox listed is ours
                with contextlib.suppress(Exception):
                    c.get(info.id).destroy()
        dep.stop()

    def box_dir(self, dep: LocalDeployment, kind: str, sandbox_id: str) -> Path:
        return dep.state_dir / "nodes" / dep.node_id / kind / "sandboxes" / sandbox_id

    def create(self, c: Client, kind: str) -> Sandbox:
        """Create one sandbox; retried on ResourceExhausted/Unavailable (counted)."""
        for attempt in range(CREATE_ATTEMPTS):
            try:
                sb = c.create(kind=kind, image=self.image, memory_mb=MEMORY_MB)
            except (ResourceExhausted, Unavailable) as exc:
                if attempt == CREATE_ATTEMPTS - 1:
                    raise
                self.retries.append(f"{kind}: {type(exc).__name__}: {str(exc)[:160]}")
                time.sleep(0.5)
                continue
            self.created += 1
            return sb
        raise AssertionError("unreachable")

    def create_first_exec(self, c: Client, kind: str) -> tuple[float, float, Sandbox]:
        """Seconds from the create call to create returned and to the first exec done."""
        t0 = time.perf_counter()
        sb = self.create(c, kind)
        t1 = time.perf_counter()
        try:
            r = sb.exec(TRUE)
            t2 = time.perf_counter()
            if not r.ok:
                raise RuntimeError(f"`true` failed in {kind} {sb.id}: {r}")
        except BaseException:
            sb.destroy()
            raise
        return t1 - t0, t2 - t0, sb

    def note_accel(self, dep: LocalDeployment) -> None:
        """The accelerator per kind from the node's capabilities, else from the probe."""
        try:
            with Client(dep.url, timeout_s=30) as c:
                nodes = c.nodes()
            node = next(n for n in nodes if n.node_id == dep.node_id)
            self.offered = [k for k in self.kinds if k in node.kinds]
            for kind in self.kinds:
                caps = node.capabilities.get(kind)
                if caps:
                    reason = " ".join(str(caps.get("accel_reason", "")).split())
                    self.accel[kind] = f"{caps.get('accel')} ({reason})"
        except Exception as exc:
            self.console.print(f"node capabilities not reachable ({exc}); probing")
        if not self.accel:
            from sandfleet.backends.vm.accel import probe_accel
            from sandfleet.backends.vm.guest import guest_artifacts

            info = probe_accel(guest_artifacts())
            reason = " ".join(info.reason.split())
            self.accel = {k: f"{info.name} ({reason}) [local probe]" for k in self.kinds}
        for kind in self.kinds:
            self.console.print(f"{kind}: accelerator {self.accel.get(kind, '?')}")
        missing = [k for k in self.kinds if k not in self.offered]
        if missing:
            self.console.print(
                f"[red]the node does not offer {', '.join(missing)}; skipped.[/] Its log:\n"
                + "\n".join(dep.log().splitlines()[-20:])
            )

    # ------------------------------------------------------------------ 1. cold boot

    def cold_boot(self, dep: LocalDeployment) -> None:
        n = self.counts.cold
        t = self.table(
            f"1. cold boot (SANDFLEET_VM_TEMPLATES=0), {n} sequential creates, memory_mb="
            f"{MEMORY_MB}",
            "kind",
            "create returned p50",
            "min",
            "max",
            "→ first exec done p50",
            "min",
            "max",
            "idle RSS (last one)",
        )
        with Client(dep.url, timeout_s=TIMEOUT_S) as c:
            for kind in self.offered:
                creates: list[float] = []
                firsts: list[float] = []
                for i in range(n):
                    cr, fe, sb = self.create_first_exec(c, kind)
                    creates.append(cr)
                    firsts.append(fe)
                    try:
                        if i == n - 1:
                            time.sleep(3.0)
                            pids = qemu_pids(self.box_dir(dep, kind, sb.id))
                            if pids:
                                self.cold_rss[kind] = smaps_rollup(pids[0])
                    finally:
                        sb.destroy()
                templates = list((dep.state_dir / "nodes" / dep.node_id / kind).glob("templates/*"))
                if templates:
                    self.console.print(
                        f"[red]{kind}: templates made with templates off:[/] {templates}"
                    )
                rss = self.cold_rss.get(kind, {})
                t.add_row(
                    kind,
                    sec(pct(creates, 50)),
                    sec(min(creates)),
                    sec(max(creates)),
                    sec(pct(firsts, 50)),
                    sec(min(firsts)),
                    sec(max(firsts)),
                    mib(rss.get("Rss", 0)) if rss else "?",
                )
                method = (
                    f"{n} sequential Client.create(kind, memory_mb={MEMORY_MB}) with"
                    " SANDFLEET_VM_TEMPLATES=0; destroy after each (untimed)"
                )
                self.row(
                    "cold boot: create returned (agent ready), p50 [min-max]",
                    kind,
                    f"{sec(pct(creates, 50))} [{sec(min(creates))}-{sec(max(creates))}]",
                    method=method,
                )
                self.row(
                    "cold boot: create → first exec done, p50 [min-max]",
                    kind,
                    f"{sec(pct(firsts, 50))} [{sec(min(firsts))}-{sec(max(firsts))}]",
                    method=method + "; exec(['true']) after create",
                )
                self.cold_create_p50[kind] = pct(creates, 50)
        self.console.print(t)

    # ------------------------------------------------------------------ 2. template build

    def template_build(self, dep: LocalDeployment, c: Client) -> None:
        t = self.table(
            "2. template build: first create of a fresh key (boot + save + restore)",
            "kind",
            "create returned",
            "→ first exec done",
            "minus cold boot p50",
            "template RAM file (apparent / allocated)",
            "device state",
        )
        for kind in self.offered:
            cr, fe, sb = self.create_first_exec(c, kind)
            sb.destroy()
            tdirs = [
                p
                for p in (dep.state_dir / "nodes" / dep.node_id / kind / "templates").iterdir()
                if not p.name.startswith(".")
            ]
            mem = file_sizes(tdirs[0] / "mem") if tdirs else (0, 0)
            state = file_sizes(tdirs[0] / "state") if tdirs else (0, 0)
            cold = self.cold_create_p50.get(kind)
            extra = f"{cr - cold:+.2f} s" if cold is not None else "?"
            t.add_row(
                kind,
                sec(cr),
                sec(fe),
                extra,
                f"{mem[0] / 2**20:.0f} / {mem[1] / 2**20:.0f} MiB",
                f"{state[0] / 2**20:.1f} MiB",
            )
            self.row(
                "template build: first create of a key → returned / → first exec done",
                kind,
                f"{sec(cr)} / {sec(fe)} ({extra} vs cold create p50)",
                method="1 create in a fresh state directory with templates on: boot, quiesce,"
                " save RAM + device state, restore a clone",
            )
            self.row(
                "template on disk: RAM file (apparent / allocated), device state",
                kind,
                f"{mem[0] / 2**20:.0f} / {mem[1] / 2**20:.0f} MiB, {state[0] / 2**20:.1f} MiB",
                method="templates/<key>/mem and state",
            )
        self.console.print(t)

    # ------------------------------------------------------------------ 3. create from template

    def from_template(self, dep: LocalDeployment, c: Client) -> None:
        n, burst = self.counts.seq, self.counts.burst
        t = self.table(
            f"3. create from the template → first exec done ({n} sequential; {burst} at once)",
            "kind",
            "create returned p50",
            "→ first exec p50",
            "p90",
            "max",
            f"{burst} at once: wall",
            "each p50",
            "each max",
        )
        for kind in self.offered:
            creates: list[float] = []
            firsts: list[float] = []
            for _ in range(n):
                cr, fe, sb = self.create_first_exec(c, kind)
                sb.destroy()
                creates.append(cr)
                firsts.append(fe)
            wall, each = asyncio.run(self.burst(dep, kind, burst))
            p50 = pct(firsts, 50)
            t.add_row(
                kind,
                ms(pct(creates, 50)),
                ms(p50),
                ms(pct(firsts, 90)),
                ms(max(firsts)),
                sec(wall),
                sec(pct(each, 50)),
                sec(max(each)),
            )
            goal = f"≤ {GOAL_CREATE_S} s (microvm)"
            if kind == "microvm":
                goal += f": {'met' if p50 <= GOAL_CREATE_S else 'missed'}"
            self.row(
                "create from template → first exec done, p50 / p90",
                kind,
                f"{ms(p50)} / {ms(pct(firsts, 90))} (create alone p50 {ms(pct(creates, 50))})",
                goal=goal if kind == "microvm" else "—",
                method=f"{n} sequential Client.create + exec(['true']), destroy after each"
                " (untimed)",
            )
            self.row(
                f"{burst} creates from template at once → all first execs done",
                kind,
                f"{sec(wall)} wall (each p50 {sec(pct(each, 50))}, max {sec(max(each))})",
                method=f"asyncio.gather of {burst} x AsyncClient create + exec; destroy after",
            )
        self.console.print(t)

    async def burst(self, dep: LocalDeployment, kind: str, n: int) -> tuple[float, list[float]]:
        """``n`` creates + first exec at once; wall seconds and each one's seconds."""
        boxes: list[AsyncSandbox] = []
        each: list[float] = []
        async with AsyncClient(dep.url, timeout_s=TIMEOUT_S) as client:

            async def one() -> None:
                t0 = time.perf_counter()
                sb = await client.create(kind=kind, image=self.image, memory_mb=MEMORY_MB)
                boxes.append(sb)
                self.created += 1
                r = await sb.exec(TRUE)
                if not r.ok:
                    raise RuntimeError(f"`true` failed in {kind} {sb.id}: {r}")
                each.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            try:
                results = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
                wall = time.perf_counter() - t0
            finally:
                await asyncio.gather(*(b.destroy() for b in boxes), return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
        return wall, each

    # ------------------------------------------------------------------ 4. exec, 5. pause

    def exec_and_pause(self, dep: LocalDeployment, c: Client) -> None:
        for kind in self.offered:
            sb = self.create_first_exec(c, kind)[2]
            try:
                self.exec_round_trip(dep, kind, sb)
                self.pause_resume(dep, kind, sb)
            finally:
                sb.destroy()

    def exec_round_trip(self, dep: LocalDeployment, kind: str, sb: Sandbox) -> None:
        n = self.counts.execs
        for _ in range(10):
            sb.exec(TRUE)
        sdk: list[float] = []
        agent_side: list[float] = []
        for _ in range(n):
            t0 = time.perf_counter()
            r = sb.exec(TRUE)
            sdk.append(time.perf_counter() - t0)
            agent_side.append(r.duration_s)
        sock = self.box_dir(dep, kind, sb.id) / "agent.sock"
        direct, direct_agent = asyncio.run(agent_client_execs(sock, n))
        t = self.table(
            f"4. {kind}: exec round trip of `true`, {n} sequential calls after 10 warm-up",
            "path",
            "p50",
            "p90",
            "max",
        )
        for what, xs in (
            ("sync Client (SDK → control plane → node → mux → guest agent)", sdk),
            ("  the agent's own duration_s (fork/exec/wait in the guest)", agent_side),
            ("AgentClient on <sandbox dir>/agent.sock (mux → virtio-serial → agent)", direct),
            ("  the agent's own duration_s", direct_agent),
        ):
            t.add_row(what, ms(pct(xs, 50)), ms(pct(xs, 90)), ms(max(xs)))
        self.console.print(t)
        p50 = pct(sdk, 50)
        goal = f"≤ {GOAL_EXEC_S * 1000:.0f} ms (microvm)"
        if kind == "microvm":
            goal += f": {'met' if p50 <= GOAL_EXEC_S else 'missed'}"
        self.row(
            "exec `true` round trip, sync Client, p50 / p90",
            kind,
            f"{ms(p50)} / {ms(pct(sdk, 90))}",
            goal=goal if kind == "microvm" else "—",
            method=f"{n} sequential sb.exec(['true']) on one sandbox after 10 warm-up",
        )
        self.row(
            "  of which the agent's own duration_s, p50",
            kind,
            ms(pct(agent_side, 50)),
            method="ExecResult.duration_s of the same calls: fork/exec/wait inside the guest",
        )
        self.row(
            "exec via AgentClient on the mux socket (no HTTP), p50 / p90",
            kind,
            f"{ms(pct(direct, 50))} / {ms(pct(direct, 90))}",
            method=f"{n} x AgentClient(<sandbox dir>/agent.sock).exec, one connection each",
        )

    def pause_resume(self, dep: LocalDeployment, kind: str, sb: Sandbox) -> None:
        n = self.counts.cycles
        box = self.box_dir(dep, kind, sb.id)
        pauses: list[float] = []
        resumes: list[float] = []
        firsts: list[float] = []
        implicit_pause: list[float] = []
        implicit: list[float] = []
        sizes: list[int] = []
        allocated: list[int] = []
        qemu_left = 0
        for _ in range(n):
            t0 = time.perf_counter()
            sb.pause()
            pauses.append(time.perf_counter() - t0)
            size, alloc = file_sizes(box / "paused.state")
            sizes.append(size)
            allocated.append(alloc)
            qemu_left += len(qemu_pids(box))
            t0 = time.perf_counter()
            sb.resume()
            resumes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            r = sb.exec(TRUE)
            firsts.append(time.perf_counter() - t0)
            if not r.ok:
                raise RuntimeError(f"`true` failed after resume in {kind} {sb.id}: {r}")
        for _ in range(n):
            t0 = time.perf_counter()
            sb.pause()
            implicit_pause.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            r = sb.exec(TRUE)
            implicit.append(time.perf_counter() - t0)
            if not r.ok:
                raise RuntimeError(f"`true` failed on a paused {kind} {sb.id}: {r}")
        t = self.table(
            f"5. {kind}: pause / resume, {n} cycles (+ {n} where exec resumes)",
            "what",
            "p50",
            "max",
        )
        for what, xs in (
            ("sb.pause()", pauses + implicit_pause),
            ("sb.resume()", resumes),
            ("first exec `true` after resume()", firsts),
            ("resume() + first exec", [a + b for a, b in zip(resumes, firsts, strict=True)]),
            ("exec `true` on the paused sandbox (resumes it)", implicit),
        ):
            t.add_row(what, sec(pct(xs, 50)), sec(max(xs)))
        t.add_row(
            "paused.state apparent / allocated",
            f"{statistics.median(sizes) / 2**20:.1f} / {statistics.median(allocated) / 2**20:.1f}"
            " MiB",
            f"{max(sizes) / 2**20:.1f} MiB",
        )
        self.console.print(t)
        if qemu_left:
            self.console.print(f"[red]{kind}: QEMU still running while paused: {qemu_left}[/]")
        method = f"{n} cycles on one idle sandbox (memory_mb={MEMORY_MB})"
        self.row(
            "pause: sb.pause(), p50; paused.state size",
            kind,
            f"{sec(pct(pauses + implicit_pause, 50))}; "
            f"{statistics.median(sizes) / 2**20:.0f} MiB"
            f" ({statistics.median(allocated) / 2**20:.0f} MiB allocated)",
            method=f"{2 * n} pauses; size = st_size (st_blocks * 512) of paused.state",
        )
        self.row(
            "resume: sb.resume() / first exec after it, p50",
            kind,
            f"{sec(pct(resumes, 50))} / {ms(pct(firsts, 50))}",
            method=method,
        )
        self.row(
            "exec `true` on a paused sandbox (implicit resume), p50",
            kind,
            sec(pct(implicit, 50)),
            method=f"{n} cycles of pause, then exec timed",
        )

    # ------------------------------------------------------------------ 6. memory

    def idle_memory(self, dep: LocalDeployment, c: Client) -> None:
        n = self.counts.idle
        t = self.table(
            f"6. host memory of idle VMs: {n} per kind from the template, memory_mb={MEMORY_MB}"
            f" (guest RAM {MEMORY_MB} + 96 MiB overhead)",
            "kind",
            "RSS mean",
            "RSS total",
            "PSS mean",
            "PSS total",
            "Anonymous mean",
            "idle CPU mean",
            "cold-booted VM RSS / PSS (Anon)",
        )
        for kind in self.offered:
            boxes: list[Sandbox] = []
            try:
                for _ in range(n):
                    boxes.append(self.create_first_exec(c, kind)[2])
                time.sleep(5.0)
                pids = [p for sb in boxes for p in qemu_pids(self.box_dir(dep, kind, sb.id))]
                rolls = [smaps_rollup(p) for p in pids]
                cpu = idle_cpu_percent(pids)
            finally:
                for sb in boxes:
                    with contextlib.suppress(Exception):
                        sb.destroy()
            if len(pids) != n:
                self.console.print(f"[red]{kind}: found {len(pids)} QEMU processes for {n} VMs[/]")
            if not rolls:
                continue
            rss = [r.get("Rss", 0) for r in rolls]
            pss = [r.get("Pss", 0) for r in rolls]
            anon = [r.get("Anonymous", 0) for r in rolls]
            cold = self.cold_rss.get(kind, {})
            cold_s = (
                f"{mib(cold['Rss'])} / {mib(cold['Pss'])} (Anonymous {mib(cold['Anonymous'])})"
                if cold
                else "?"
            )
            t.add_row(
                kind,
                mib(statistics.fmean(rss)),
                mib(sum(rss)),
                mib(statistics.fmean(pss)),
                mib(sum(pss)),
                mib(statistics.fmean(anon)),
                f"{statistics.fmean(cpu):.1f} %",
                cold_s,
            )
            self.row(
                f"host memory per idle VM ({n} idle): RSS / PSS mean",
                kind,
                f"{mib(statistics.fmean(rss))} / {mib(statistics.fmean(pss))}"
                f" (total {mib(sum(rss))} / {mib(sum(pss))})",
                method="smaps_rollup of each QEMU (found by -pidfile <sandbox dir>/pid) after"
                " 5 s idle; clones map the template RAM file copy-on-write, so PSS < RSS",
            )
            self.row(
                "  of which Anonymous (TCG code cache, QEMU heap, pages the guest wrote), mean",
                kind,
                mib(statistics.fmean(anon)),
                method="smaps_rollup Anonymous",
            )
            self.row(
                "idle QEMU CPU, mean",
                kind,
                f"{statistics.fmean(cpu):.1f} % of a core",
                method="utime + stime over 5 s of the same idle QEMUs",
            )
            self.row(
                "cold-booted VM (no template) RSS / PSS (Anonymous)",
                kind,
                cold_s,
                method="the last VM of 1., 3 s after its first exec",
            )
        self.console.print(t)

    # ------------------------------------------------------------------ run

    def run(self) -> None:
        self.console.print(
            f"sandfleet VM benchmark: {self.image}, kinds {', '.join(self.kinds)}, "
            f"{os.cpu_count()} cores, loadavg {loadavg()}, work dir {self.work}"
        )
        with self.deployment("cold", {"SANDFLEET_VM_TEMPLATES": "0"}) as dep:
            self.note_accel(dep)
            self.cold_boot(dep)
        with (
            self.deployment("templates", {}) as dep,
            Client(dep.url, timeout_s=TIMEOUT_S) as c,
        ):
            self.template_build(dep, c)
            self.from_template(dep, c)
            self.exec_and_pause(dep, c)
            self.idle_memory(dep, c)
        t = self.table("summary", "what", *self.offered, "goal", "method")
        for r in self.rows.values():
            t.add_row(r.what, *(r.values.get(k, "") for k in self.offered), r.goal, r.method)
        self.console.print(t)
        for kind in self.offered:
            self.console.print(f"{kind}: accelerator {self.accel.get(kind, '?')}")
        self.console.print(f"loadavg at the end: {loadavg()}")
        self.console.print(
            f"create attempts refused and retried: {len(self.retries)}"
            + "".join(f"\n  {k}" for k in sorted(set(self.retries)))
        )

    def cleanup(self) -> list[str]:
        """Stop every deployment still running; returns the leftovers of all of them."""
        left: list[str] = []
        for dep in self.deps:
            with contextlib.suppress(Exception):
                self.stop(dep)
            left += [f"{dep.state_dir.parent.name}: {x}" for x in leftovers(dep.state_dir)]
        return left


async def agent_client_execs(sock: Path, n: int) -> tuple[list[float], list[float]]:
    """``n`` sequential execs of ``true`` through AgentClient; round trips and duration_s."""
    agent = AgentClient(sock)
    req = ExecRequest(cmd=TRUE)
    times: list[float] = []
    durations: list[float] = []
    for i in range(n + 10):
        t0 = time.perf_counter()
        r = await agent.exec(req)
        if i >= 10:
            times.append(time.perf_counter() - t0)
            durations.append(r.duration_s)
    return times, durations


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _kinds(value: str) -> list[str]:
    kinds = [k.strip() for k in value.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"kinds are a comma-separated subset of {','.join(KINDS)}")
    return kinds


def main() -> int:
    default_images = (
        Path(os.environ.get("SANDFLEET_TEST_CACHE", "/var/tmp/sandfleet-test-cache")) / "images"
    )
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument(
        "--images-dir",
        type=Path,
        default=default_images,
        help=f"image store; {BUSYBOX} is built into it if missing (default {default_images})",
    )
    ap.add_argument(
        "--kinds", type=_kinds, default=list(KINDS), help="comma-separated (default microvm,vm)"
    )
    ap.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    ap.add_argument(
        "--debian",
        action="store_true",
        help=f"use the demo's {DEBIAN} (built if missing, ~90 s) instead of busybox",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_vms.py must run as root (QEMU, cgroups, mounts)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    console = Console()
    if args.debian:
        from sandfleet.cli.demo import ensure_demo_images

        ensure_demo_images(args.images_dir, console)
    else:
        ensure_busybox(args.images_dir, console)
    work = Path(tempfile.mkdtemp(prefix="sandfleet-bench-vms-", dir="/var/tmp"))
    bench = Bench(
        work,
        args.images_dir,
        DEBIAN if args.debian else BUSYBOX,
        args.kinds,
        QUICK if args.quick else FULL,
    )
    ok = False
    try:
        bench.run()
        ok = True
    finally:
        left = bench.cleanup()
        if left:
            console.print("[red]left behind:[/]\n  " + "\n  ".join(left))
            console.print(f"work dir kept for inspection: {work}")
        else:
            console.print(
                f"leftovers(state_dir) of {len(bench.deps)} deployment(s) after {bench.created}"
                " sandboxes: none — no QEMU, sandbox process, mount, cgroup or state dir left"
            )
            if not ok:
                notable = [
                    line
                    for dep in bench.deps
                    for line in dep.log().splitlines()
                    if any(w in line for w in ("WARNING", "ERROR", "Traceback", "failed"))
                ]
                console.print(
                    "the run failed; the deployments' warnings and errors:\n"
                    + "\n".join(notable[-40:])
                )
            shutil.rmtree(work, ignore_errors=True)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
