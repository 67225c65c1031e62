"""Lifecycles on real runc boxes: pause/resume with the freezer, TTLs, idle TTLs, restarts.

The first tests share one `sandfleet up`; those about restarts run the control
plane and the node agent as separate processes (the node keeps its boxes when
it stops), so each can be killed and started again on its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from sandfleet import errors
from sandfleet.cli.local import LocalDeployment
from sandfleet.cli.serve import free_port
from sandfleet.sdk import AsyncClient, Client, Sandbox
from tests.conftest import BUSYBOX_IMAGE, assert_clean

pytestmark = pytest.mark.root

TOKEN = "lifecycle-test-token"
#: Appends to /tmp/n as fast as it can (on the overlay, so the host can read its size).
COUNTER = "while :; do echo x >> /tmp/n; done"


def _eventually(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def _gone(client: Client, sandbox_id: str) -> bool:
    try:
        client.get(sandbox_id)
    except errors.NotFound:
        return True
    return False


def _bundle(state_dir: Path, sandbox_id: str) -> Path:
    found = list(state_dir.glob(f"nodes/*/container/sandboxes/{sandbox_id}"))
    assert len(found) == 1, found
    return found[0]


def _counter(state_dir: Path, sandbox_id: str) -> int:
    """The size of the box's /tmp/n, seen from the host (a call would resume the box)."""
    return (_bundle(state_dir, sandbox_id) / "rootfs" / "tmp" / "n").stat().st_size


def _cpu_ns(sandbox_id: str) -> int:
    """CPU time used by the box's cgroup so far, nanoseconds (v1 cpuacct or v2 cpu.stat)."""
    v1 = Path("/sys/fs/cgroup/cpuacct/sandfleet", sandbox_id, "cpuacct.usage")
    if v1.exists():
        return int(v1.read_text())
    for line in Path("/sys/fs/cgroup/sandfleet", sandbox_id, "cpu.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            return int(value) * 1000
    raise AssertionError("no CPU accounting for the box")


def _started_counting(sb: Sandbox, state_dir: Path) -> None:
    sb.spawn(["sh", "-c", COUNTER])
    _eventually(
        lambda: (_bundle(state_dir, sb.id) / "rootfs/tmp/n").exists(), 10, "the counter starts"
    )


# --------------------------------------------------------------------------- one `up`


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, images_dir: Path) -> Iterator[LocalDeployment]:
    state = tmp_path_factory.mktemp("lifecycle") / "state"
    with LocalDeployment(state, images_dir) as dep:
        yield dep
    assert_clean(dep.state_dir)


@pytest.fixture
def client(up: LocalDeployment) -> Iterator[Client]:
    with Client(up.url) as c:
        yield c
        for info in c.list():
            c.get(info.id).destroy()


def test_paused_sandbox_stops_costs_no_cpu_and_resumes_on_any_call(
    up: LocalDeployment, client: Client
) -> None:
    sb = client.create(image=BUSYBOX_IMAGE, memory_mb=64)
    sb.files.write("/root/kept", b"state")
    _started_counting(sb, up.state_dir)
    sb.pause()
    assert sb.info.state == "paused" and client.get(sb.id).info.state == "paused"
    assert [s.state for s in client.list()] == ["paused"]
    count, cpu = _counter(up.state_dir, sb.id), _cpu_ns(sb.id)
    time.sleep(0.5)
    assert _counter(up.state_dir, sb.id) == count, "a paused box went on counting"
    assert _cpu_ns(sb.id) - cpu < 1_000_000, "a paused box used CPU"
    sb.pause()  # idempotent

    # Any call resumes it first: here an exec, which sees the counter move on.
    result = sb.exec(
        ["sh", "-c", "a=$(wc -c < /tmp/n); sleep 0.2; b=$(wc -c < /tmp/n); echo $a $b"]
    )
    first, second = map(int, result.stdout.split())
    assert count <= first < second
    assert client.get(sb.id).info.state == "running"
    assert sb.files.read("/root/kept") == b"state"

    # Explicit pause and resume; a file read resumes too.
    sb.pause()
    sb.resume()
    assert sb.info.state == "running"
    sb.resume()  # idempotent
    sb.pause()
    assert sb.files.read("/root/kept") == b"state"
    assert client.get(sb.id).info.state == "running"
    sb.destroy()


def test_destroying_a_paused_sandbox_leaves_nothing(up: LocalDeployment, client: Client) -> None:
    sb = client.create(image=BUSYBOX_IMAGE, memory_mb=64)
    _started_counting(sb, up.state_dir)
    sb.pause()
    sb.destroy()
    assert _gone(client, sb.id)
    from sandfleet.node.leaks import leftovers

    assert leftovers(up.state_dir, only={sb.id}) == []


def test_idle_ttl_reclaims_after_no_calls_but_not_while_they_come(client: Client) -> None:
    sb = client.create(image=BUSYBOX_IMAGE, memory_mb=64, idle_ttl_s=1.5)
    assert sb.info.idle_ttl_s == 1.5 and sb.info.last_active_at is not None
    # Calls every 0.4 s for 3 s (twice the idle TTL): it stays.
    for _ in range(8):
        assert sb.exec("true").ok
        time.sleep(0.4)
    # A call longer than the idle TTL is not idleness.
    assert sb.exec("sleep 2.2").ok
    t0 = time.monotonic()
    _eventually(lambda: _gone(client, sb.id), 6, "an idle sandbox is reclaimed")
    assert time.monotonic() - t0 >= 1.0
    # Both the record and a call on it say why it is gone.
    with pytest.raises(errors.NotFound, match="idle TTL ended"):
        client.get(sb.id)
    with pytest.raises(errors.NotFound, match="no longer exists"):
        sb.exec("true")


def test_a_paused_sandbox_is_not_idle_and_its_idle_clock_restarts_at_resume(
    client: Client,
) -> None:
    sb = client.create(image=BUSYBOX_IMAGE, memory_mb=64, idle_ttl_s=1.5)
    sb.pause()
    time.sleep(3.0)  # twice the idle TTL, paused: waiting for its trainer
    assert not _gone(client, sb.id)
    sb.resume()
    assert sb.exec("echo back").stdout == b"back\n"
    _eventually(lambda: _gone(client, sb.id), 10, "the resumed sandbox reclaimed when idle")


def test_a_snapshot_leaves_a_paused_sandbox_paused(client: Client) -> None:
    sb = client.create(image=BUSYBOX_IMAGE, memory_mb=64)
    sb.exec("echo kept > /root/mark")
    sb.pause()
    image = sb.snapshot()
    assert sb.refresh().state == "paused"
    with client.create(image=image, memory_mb=64) as copy:
        assert copy.exec("cat /root/mark").stdout == b"kept\n"
    sb.destroy()


def test_lifetimes_change_by_a_call(client: Client) -> None:
    sb = client.create(image=BUSYBOX_IMAGE, memory_mb=64, ttl_s=600)
    with pytest.raises(errors.InvalidArgument, match="ttl_s and/or idle_ttl_s"):
        sb.set_lifetime()
    with pytest.raises(errors.InvalidArgument, match="out of range"):
        sb.set_lifetime(ttl_s=-1)
    with pytest.raises(errors.InvalidArgument, match="out of range"):
        client.create(image=BUSYBOX_IMAGE, idle_ttl_s=0)
    info = sb.set_lifetime(ttl_s=None, idle_ttl_s=300)
    assert info.expires_at is None and info.idle_ttl_s == 300
    info = sb.set_lifetime(ttl_s=1.5)  # idle TTL kept
    assert info.idle_ttl_s == 300 and info.expires_at is not None
    assert info.expires_at - time.time() == pytest.approx(1.5, abs=0.5)
    assert client.get(sb.id).info.expires_at == info.expires_at
    _eventually(lambda: _gone(client, sb.id), 5, "the new TTL reclaims it")


def test_group_pause_and_resume_by_labels_in_parallel(up: LocalDeployment, client: Client) -> None:
    job = [client.create(image=BUSYBOX_IMAGE, memory_mb=32, labels={"job": "a"}) for _ in range(4)]
    other = client.create(image=BUSYBOX_IMAGE, memory_mb=32, labels={"job": "b"})
    _started_counting(job[0], up.state_dir)
    with pytest.raises(errors.InvalidArgument, match="needs labels"):
        client.pause(labels={})
    done = client.pause(labels={"job": "a"})
    assert done.sandboxes == sorted(s.id for s in job) and done.failed == {}
    states = {s.id: s.state for s in client.list()}
    assert [states[s.id] for s in job] == ["paused"] * 4 and states[other.id] == "running"
    count = _counter(up.state_dir, job[0].id)
    time.sleep(0.3)
    assert _counter(up.state_dir, job[0].id) == count
    assert client.pause(labels={"job": "none"}).sandboxes == []
    done = client.resume(labels={"job": "a"})
    assert done.sandboxes == sorted(s.id for s in job)
    assert {s.state for s in client.list()} == {"running"}
    _eventually(lambda: _counter(up.state_dir, job[0].id) > count, 5, "the counter moves on")


def test_async_surface_pauses_and_sets_lifetimes(up: LocalDeployment) -> None:
    import asyncio

    async def main() -> None:
        async with (
            AsyncClient(up.url) as client,
            await client.create(image=BUSYBOX_IMAGE, labels={"job": "z"}) as sb,
        ):
            await sb.pause()
            assert sb.info.state == "paused"
            assert (await client.resume(labels={"job": "z"})).sandboxes == [sb.id]
            info = await sb.set_lifetime(idle_ttl_s=60)
            assert info.idle_ttl_s == 60
            await sb.pause()
            assert (await sb.exec("echo hi")).stdout == b"hi\n"

    asyncio.run(main())


# --------------------------------------------------------------------------- split servers


class Split:
    """A control plane and one node agent as separate processes over one state dir."""

    def __init__(self, tmp: Path, images_dir: Path) -> None:
        self.tmp = tmp
        self.state = tmp / "state"
        self.common = ["--state-dir", str(self.state), "--images-dir", str(images_dir)]
        self.cp_port, self.node_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.cp_port}"
        self.node_url = f"http://127.0.0.1:{self.node_port}"
        self.node_id = "lc-node"
        self.cp: subprocess.Popen[bytes] | None = None
        self.node: subprocess.Popen[bytes] | None = None

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen[bytes]:
        with open(self.tmp / log, "ab") as fh:
            return subprocess.Popen(
                [sys.executable, "-m", "sandfleet.cli", *args, *self.common],
                stdout=fh,
                stderr=fh,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "SANDFLEET_NODE_TOKEN": TOKEN},
            )

    def start_cp(self) -> None:
        """Start the control plane; once a node agent runs, wait until it has registered."""
        self.cp = self._spawn(["controlplane", "--port", str(self.cp_port)], "cp.log")
        if self.node is not None and self.node.poll() is None:
            self.wait_registered()

    def start_node(self) -> None:
        args = ["node", "--node-id", self.node_id, "--control-plane", self.url]
        self.node = self._spawn([*args, "--port", str(self.node_port), "--keep"], "node.log")
        self.wait_registered()

    def wait_registered(self) -> None:
        t0 = time.time()

        def ready() -> bool:
            try:
                nodes = httpx.get(f"{self.url}/v1/nodes", timeout=1).json()["nodes"]
                httpx.get(f"{self.node_url}/healthz", timeout=1).raise_for_status()
            except (httpx.HTTPError, KeyError, ValueError):
                return False
            return any(n["healthy"] and n["last_heartbeat"] >= t0 for n in nodes)

        _eventually(ready, 30, "the node registers")

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGKILL) -> None:
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(30)

    def kill_cp(self) -> None:
        self._kill(self.cp)

    def kill_node(self) -> None:
        self._kill(self.node)

    def hosted(self) -> list[str]:
        """The ids the node agent hosts, asked of the node itself."""
        auth = {"authorization": f"Bearer {TOKEN}"}
        ids: list[str] = httpx.get(f"{self.node_url}/v1/sandboxes", headers=auth).json()["ids"]
        return ids

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in self.tmp.glob("*.log"))


@pytest.fixture
def split(tmp_path: Path, images_dir: Path) -> Iterator[Split]:
    s = Split(tmp_path, images_dir)
    try:
        s.start_cp()
        s.start_node()
        yield s
    finally:
        alive = [p for p in (s.cp, s.node) if p is not None and p.poll() is None]
        if len(alive) == 2:
            with Client(s.url) as c:
                for info in c.list():
                    c.get(info.id).destroy()
        s._kill(s.node, signal.SIGTERM)
        s._kill(s.cp, signal.SIGTERM)
    assert_clean(s.state)


def test_node_reaps_on_its_own_deadlines_with_the_control_plane_down(split: Split) -> None:
    with Client(split.url) as client:
        hard = client.create(image=BUSYBOX_IMAGE, memory_mb=32, ttl_s=2)
        idle = client.create(image=BUSYBOX_IMAGE, memory_mb=32, idle_ttl_s=1.5)
        kept = client.create(image=BUSYBOX_IMAGE, memory_mb=32)
    split.kill_cp()
    _eventually(lambda: split.hosted() == [kept.id], 6, "the node reaps both without the CP")
    split.start_cp()
    with Client(split.url) as client:
        # The node re-registered: the records of what it reaped are closed.
        assert _gone(client, hard.id) and _gone(client, idle.id)
        assert [s.id for s in client.list()] == [kept.id]


def test_control_plane_restart_keeps_sandboxes_reachable(split: Split) -> None:
    with Client(split.url) as client:
        running = client.create(image=BUSYBOX_IMAGE, memory_mb=32, idle_ttl_s=120)
        running.files.write("/root/a", b"A")
        paused = client.create(image=BUSYBOX_IMAGE, memory_mb=32)
        paused.pause()
    split.kill_cp()
    split.start_cp()
    with Client(split.url) as client:
        again = client.get(running.id)
        assert again.info.idle_ttl_s == 120
        assert again.files.read("/root/a") == b"A"
        assert client.get(paused.id).info.state == "paused"
        assert client.get(paused.id).exec("echo back").stdout == b"back\n"
        assert client.get(paused.id).info.state == "running"


def test_node_destroys_at_registration_a_box_the_control_plane_has_no_record_of(
    split: Split,
) -> None:
    stray = f"sb-{os.urandom(6).hex()}-{split.node_id}"
    auth = {"authorization": f"Bearer {TOKEN}"}
    r = httpx.post(
        f"{split.node_url}/v1/sandboxes",
        headers=auth,
        timeout=60,
        json={"id": stray, "image": BUSYBOX_IMAGE, "memory_mb": 32},
    )
    r.raise_for_status()
    with Client(split.url) as client:
        known = client.create(image=BUSYBOX_IMAGE, memory_mb=32)
    assert sorted(split.hosted()) == sorted([stray, known.id])
    split.kill_cp()  # the node re-registers with the next one
    split.start_cp()
    _eventually(lambda: split.hosted() == [known.id], 10, "the stray box is destroyed")


def test_paused_sandbox_survives_a_node_agent_restart(split: Split) -> None:
    with Client(split.url) as client:
        sb = client.create(image=BUSYBOX_IMAGE, memory_mb=32, ttl_s=600)
        _started_counting(sb, split.state)
        sb.pause()
        count = _counter(split.state, sb.id)
        expires = client.get(sb.id).info.expires_at
    split.kill_node()
    split.start_node()
    time.sleep(0.3)
    assert _counter(split.state, sb.id) == count, "adopting it resumed it"
    assert split.hosted() == [sb.id]
    with Client(split.url) as client:
        again = client.get(sb.id)
        assert again.info.state == "paused" and again.info.expires_at == expires
        assert again.exec("cat /tmp/n").ok
        _eventually(lambda: _counter(split.state, sb.id) > count, 5, "it runs again")


def test_node_agent_restart_keeps_the_clocks(split: Split) -> None:
    with Client(split.url) as client:
        t0 = time.monotonic()
        sb = client.create(image=BUSYBOX_IMAGE, memory_mb=32, ttl_s=4)
    split.kill_node()
    split.start_node()
    assert split.hosted() == [sb.id]
    # Reclaimed 4 s after its creation, not 4 s after the restart.
    _eventually(lambda: split.hosted() == [], 4 - (time.monotonic() - t0) + 1.5, "reaped")
