"""The trajectory log on real deployments: numbering, fast-forward, Diverged, gaps,
streamed execs, export/replay, and the log surviving node-agent and control-plane restarts."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from sandfleet import errors
from sandfleet.cli.local import LocalDeployment
from sandfleet.cli.log import read_entries
from sandfleet.cli.main import cli
from sandfleet.cli.serve import free_port
from sandfleet.node.trajectory import BoxLog
from sandfleet.sdk import AsyncClient, Client, Sandbox
from sandfleet.wire.models import REPLAYED_HEADER, STEP_HEADER, ExecEvent, LogEntry
from sandfleet.wire.trajectory import LOG_BYTES
from tests.conftest import BUSYBOX_IMAGE, assert_clean

pytestmark = pytest.mark.root

APPEND = "echo once >> /root/count; wc -l < /root/count"


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory, images_dir: Path) -> Iterator[LocalDeployment]:
    """One `sandfleet up` for the tests that do not restart anything."""
    state = tmp_path_factory.mktemp("trajectory") / "state"
    # A short grace, so that the gap test does not wait the default 30 s.
    os.environ["SANDFLEET_STEP_GAP_GRACE_S"] = "1"
    try:
        with LocalDeployment(state, images_dir) as deployment:
            yield deployment
    finally:
        os.environ.pop("SANDFLEET_STEP_GAP_GRACE_S", None)
    assert_clean(deployment.state_dir)


@pytest.fixture
def client(dep: LocalDeployment) -> Iterator[Client]:
    with Client(dep.url) as c:
        yield c
        for info in c.list():
            c.get(info.id).destroy()


def _count(client: Client, sandbox_id: str) -> int:
    """Lines in /root/count, read through a handle that logs nothing."""
    return len(client.get(sandbox_id).files.read("/root/count").splitlines())


def _raw(url: str, method: str, path: str, step: int, **kw: object) -> httpx.Response:
    return httpx.request(method, url + path, headers={STEP_HEADER: str(step)}, timeout=30, **kw)  # type: ignore[arg-type]


def test_calls_are_numbered_and_logged(client: Client) -> None:
    """create() handles number their running/changing calls 0, 1, ...; reads and get() handles
    are not logged; outputs are cut in the log, with a note."""
    sb = client.create(image=BUSYBOX_IMAGE, memory_mb=128)
    assert sb.step == 0
    assert sb.exec(APPEND).stdout == b"1\n"
    sb.files.write("/root/a", b"alpha")
    sb.files.mkdir("/root/d")
    sb.files.read("/root/a")
    sb.files.stat("/root/a")
    sb.files.list("/root")
    sb.files.remove("/root/d")
    proc = sb.spawn("cat", close_stdin=False)
    proc.write_stdin(b"hello")
    proc.close_stdin()
    proc.wait(5)
    sb.processes()
    proc.remove()
    big = sb.exec(f"head -c {3 * LOG_BYTES} /dev/zero | tr '\\0' x")
    assert len(big.stdout) == 3 * LOG_BYTES  # the caller gets it all; the log keeps less
    assert sb.step == 9
    client.get(sb.id).exec("true")  # a get() handle: not logged
    assert client.get(sb.id).step is None

    log = sb.log()
    assert [(e.step, e.op) for e in log] == [
        (0, "exec"), (1, "write"), (2, "mkdir"), (3, "remove"), (4, "spawn"), (5, "stdin"),
        (6, "close_stdin"), (7, "remove_process"), (8, "exec"),
    ]  # fmt: skip
    assert all(len(e.digest) == 64 and e.at > 0 for e in log)
    assert log[1].request["sha256"] and base64.b64decode(log[1].request["content"]) == b"alpha"
    assert base64.b64decode(log[5].request["data"]) == b"hello"
    cut = log[8].result
    assert len(base64.b64decode(cut["stdout"])) == LOG_BYTES
    assert cut["stdout_dropped"] == 2 * LOG_BYTES and "cut in the log" in cut["note"]
    assert [e.step for e in sb.log(start=7)] == [7, 8]


def test_fast_forward_does_not_run_again(client: Client) -> None:
    """Re-issued calls return their logged results, marked replayed, and do not run:
    an append runs once, a spawn starts one process; the first new call runs."""
    sb = client.create(image=BUSYBOX_IMAGE, memory_mb=128)

    def episode(s: Sandbox) -> list[object]:
        first = s.exec(APPEND)
        entry = s.files.write("/root/w", "written")
        proc = s.spawn("echo started >> /root/spawned; sleep 60")
        killed = proc.kill()
        s.files.mkdir("/root/dir/sub")
        return [first, entry, proc.id, killed.state]

    original = episode(sb)
    assert _count(client, sb.id) == 1

    again = client.attach(sb.id, resume_from_log=True)
    assert again.step == 0
    t0 = time.perf_counter()
    replayed = episode(again)
    assert time.perf_counter() - t0 < 0.5
    first, *rest = replayed
    assert first.replayed and first.stdout == b"1\n"  # type: ignore[attr-defined]
    assert rest == original[1:]
    assert _count(client, sb.id) == 1
    assert client.get(sb.id).files.read("/root/spawned") == b"started\n"
    assert len(client.get(sb.id).processes()) == 1

    fresh = again.exec(APPEND)  # past the log: runs
    assert not fresh.replayed and fresh.stdout == b"2\n" and again.step == 6
    assert client.attach(sb.id).step == 6  # attach without resume continues after the end


def test_the_node_answers_replays_itself(client: Client, dep: LocalDeployment) -> None:
    """Without a fetched log (any client sending steps), the node answers from its log:
    header sandfleet-replayed: 1, nothing run; for exec, write, spawn and streamed exec."""
    sb = client.create(image=BUSYBOX_IMAGE, memory_mb=128)
    sb.exec(APPEND)
    sb.files.write("/root/w", b"data")
    sb.spawn("echo started >> /root/spawned")
    base = f"/v1/sandboxes/{sb.id}"

    r = _raw(dep.url, "POST", f"{base}/exec", 0, json={"cmd": APPEND})
    assert r.headers[REPLAYED_HEADER] == "1" and r.json()["replayed"] is True
    r = _raw(
        dep.url, "PUT", f"{base}/files/content", 1, params={"path": "/root/w"}, content=b"data"
    )
    assert r.headers[REPLAYED_HEADER] == "1" and r.json()["size"] == 4
    r = _raw(dep.url, "POST", f"{base}/processes", 2, json={"cmd": "echo started >> /root/spawned"})
    assert r.status_code == 201 and r.headers[REPLAYED_HEADER] == "1" and r.json()["id"] == "p1"
    r = _raw(dep.url, "POST", f"{base}/exec/stream", 0, json={"cmd": APPEND})
    events = [ExecEvent.model_validate_json(line) for line in r.content.splitlines()]
    assert r.headers[REPLAYED_HEADER] == "1"
    assert [e.type for e in events] == ["stdout", "result"] and events[0].data == b"1\n"
    assert events[1].result is not None and events[1].result.replayed
    time.sleep(0.2)
    assert _count(client, sb.id) == 1
    assert client.get(sb.id).files.read("/root/spawned") == b"started\n"


def test_a_different_call_is_diverged_and_a_gap_invalid(
    client: Client, dep: LocalDeployment
) -> None:
    sb = client.create(image=BUSYBOX_IMAGE, memory_mb=128)
    sb.exec(APPEND)
    sb.files.write("/root/w", b"data")

    again = client.attach(sb.id, resume_from_log=True)
    again.exec(APPEND)
    with pytest.raises(errors.Diverged, match=r"step 1 .*write /root/w"):
        again.files.write("/root/w", b"other data")  # checked against the fetched log
    assert again.step == 1  # nothing taken: the right call can follow
    assert again.files.write("/root/w", b"data").size == 4

    base = f"/v1/sandboxes/{sb.id}"
    r = _raw(dep.url, "POST", f"{base}/exec", 0, json={"cmd": "echo other >> /root/count"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "DIVERGED"
    assert "step 0" in r.json()["error"]["message"]
    r = _raw(dep.url, "PUT", f"{base}/files/content", 1, params={"path": "/root/w"}, content=b"x")
    assert r.status_code == 409
    assert client.get(sb.id).files.read("/root/w") == b"data"
    assert _count(client, sb.id) == 1

    t0 = time.monotonic()
    r = _raw(dep.url, "POST", f"{base}/exec", 5, json={"cmd": "echo gap >> /root/count"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert "gap" in r.json()["error"]["message"] and "step 2" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 5
    r = _raw(dep.url, "POST", f"{base}/exec", -1, json={"cmd": "true"})
    assert r.status_code == 400
    assert _count(client, sb.id) == 1


def test_streamed_exec_is_logged_and_replayed(client: Client, dep: LocalDeployment) -> None:
    """A streamed exec logs its final result with its output; re-issued as a stream or as a
    plain exec it is answered from the log."""

    async def main() -> None:
        async with AsyncClient(dep.url) as aclient:
            sb = await aclient.create(image=BUSYBOX_IMAGE, memory_mb=128)
            events = [e async for e in sb.exec_stream(APPEND + "; echo err >&2")]
            assert events[-1].result is not None and events[-1].result.exit_code == 0
            log = await sb.log()
            assert [e.op for e in log] == ["exec"]
            assert base64.b64decode(log[0].result["stdout"]) == b"1\n"
            assert base64.b64decode(log[0].result["stderr"]) == b"err\n"
            big = f"head -c {3 * LOG_BYTES} /dev/zero | tr '\\0' y"
            got = [e async for e in sb.exec_stream(big, max_output_bytes=None)]
            assert sum(len(e.data) for e in got) == 3 * LOG_BYTES
            cut = (await sb.log(start=1))[0].result
            assert base64.b64decode(cut["stdout"]) == b"y" * LOG_BYTES
            assert cut["stdout_dropped"] == 2 * LOG_BYTES and "cut in the log" in cut["note"]

            again = await aclient.attach(sb.id, resume_from_log=True)
            replayed = [e async for e in again.exec_stream(APPEND + "; echo err >&2")]
            assert [(e.type, e.data) for e in replayed[:-1]] == [
                ("stdout", b"1\n"),
                ("stderr", b"err\n"),
            ]
            assert replayed[-1].result is not None and replayed[-1].result.replayed
            plain = await aclient.attach(sb.id, resume_from_log=True)
            result = await plain.exec(APPEND + "; echo err >&2")
            assert result.replayed and result.stdout == b"1\n" and result.stderr == b"err\n"

    asyncio.run(main())
    assert _count(client, client.list()[0].id) == 1


def test_failed_and_cancelled_calls_leave_their_step_free(
    client: Client, dep: LocalDeployment
) -> None:
    """Only calls with a result are logged: an error, or a call cancelled by its caller
    (which kills the command), leaves the step to the next call; concurrent calls of one
    handle are all logged."""
    sb = client.create(image=BUSYBOX_IMAGE, memory_mb=128)
    with pytest.raises(errors.NotFound):
        sb.files.remove("/root/missing")
    assert sb.step == 0

    async def main() -> None:
        async with AsyncClient(dep.url) as aclient:
            asb = await aclient.attach(sb.id)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(asb.exec("sleep 30"), 0.5)
            # The handle settles the cancelled step with the node before its next call.
            await asb.exec("echo after")
            results = await asyncio.gather(*(asb.exec(f"echo {i}") for i in range(8)))
            assert all(r.ok for r in results)

    asyncio.run(main())
    log = sb.log()
    assert [e.step for e in log] == list(range(9))
    assert log[0].request["cmd"] == "echo after"
    assert sorted(e.request["cmd"] for e in log[1:]) == [f"echo {i}" for i in range(8)]


def test_export_and_replay_cli(client: Client, dep: LocalDeployment, tmp_path: Path) -> None:
    sb = client.create(image=BUSYBOX_IMAGE, memory_mb=128)
    sb.exec(APPEND)
    sb.files.write("/root/script.sh", b"echo from script\n", mode=0o755)
    sb.exec(["/root/script.sh"])
    sb.spawn("sleep 30").kill()
    runner = CliRunner()
    exported = runner.invoke(cli, ["log", "export", sb.id, "--url", dep.url])
    assert exported.exit_code == 0, exported.output
    entries = read_entries(exported.stdout_bytes)
    assert [e.op for e in entries] == ["exec", "write", "exec", "spawn", "kill"]
    assert [json.loads(line)["step"] for line in exported.stdout_bytes.splitlines()] == [
        0, 1, 2, 3, 4,
    ]  # fmt: skip
    path = tmp_path / "log.jsonl"
    path.write_bytes(exported.stdout_bytes)
    same = runner.invoke(
        cli, ["log", "replay", str(path), "--image", BUSYBOX_IMAGE, "--url", dep.url]
    )
    assert same.exit_code == 0, same.output
    assert "replayed 5 steps" in same.output and "0 differ" in same.output

    # A file put there behind the log's back: a fresh sandbox lacks it.
    client.get(sb.id).files.write("/root/secret", b"42")
    sb.exec("cat /root/secret")
    path.write_bytes(b"".join(e.model_dump_json().encode() + b"\n" for e in sb.log()))
    differs = runner.invoke(
        cli, ["log", "replay", str(path), "--image", BUSYBOX_IMAGE, "--url", dep.url]
    )
    assert differs.exit_code == 1, differs.output
    assert "1 differs" in differs.output and "exit_code=0" in differs.output
    assert len(client.list()) == 1  # the replay's sandboxes are gone


def test_torn_tail_is_cut_on_load(tmp_path: Path) -> None:
    """A crash mid-append leaves a partial line: loading keeps every whole entry."""
    path = tmp_path / "sb.log"
    whole = LogEntry(step=0, op="exec", digest="d" * 64).model_dump_json().encode() + b"\n"
    path.write_bytes(whole + b'{"step":1,"op":"ex')
    box = BoxLog(path)
    assert list(box.index) == [0] and box.next_step == 1
    assert path.read_bytes() == whole


# --------------------------------------------------------------------------- restarts


class Split:
    """A control plane and a node agent as separate processes, each killable on its own."""

    def __init__(self, root: Path, images_dir: Path) -> None:
        self.root = root
        self.images_dir = images_dir
        self.node_id = f"traj-{secrets.token_hex(3)}"
        self.port, self.node_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "SANDFLEET_NODE_TOKEN": secrets.token_hex(8),
            "SANDFLEET_LOG_LEVEL": "warning",
            "SANDFLEET_HEARTBEAT_INTERVAL_S": "0.5",
        }
        self.cp: subprocess.Popen[bytes] | None = None
        self.node: subprocess.Popen[bytes] | None = None

    @property
    def node_state(self) -> Path:
        return self.root / "node"

    def _run(self, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.root / "log", "ab")  # noqa: SIM115 - handed to the child
        try:
            cmd = [sys.executable, "-m", "sandfleet.cli", *args]
            return subprocess.Popen(cmd, stdout=log, stderr=log, env=self.env)
        finally:
            log.close()

    def start_cp(self) -> None:
        self.cp = self._run(
            "controlplane", "--state-dir", str(self.root / "cp"), "--images-dir",
            str(self.images_dir), "--port", str(self.port),
        )  # fmt: skip

    def start_node(self) -> None:
        self.node = self._run(
            "node", "--state-dir", str(self.node_state), "--images-dir", str(self.images_dir),
            "--node-id", self.node_id, "--control-plane", self.url, "--port",
            str(self.node_port), "--keep",
        )  # fmt: skip

    def ready(self, since: float) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                nodes = httpx.get(f"{self.url}/v1/nodes", timeout=1).json()["nodes"]
                if any(n["healthy"] and n["last_heartbeat"] >= since for n in nodes):
                    return
            time.sleep(0.1)
        raise AssertionError("not ready: " + (self.root / "log").read_text()[-3000:])

    @staticmethod
    def kill(proc: subprocess.Popen[bytes] | None) -> None:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        for proc in (self.node, self.cp):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.kill(proc)


@pytest.fixture
def split(tmp_path: Path, images_dir: Path) -> Iterator[Split]:
    s = Split(tmp_path, images_dir)
    t0 = time.time()
    s.start_cp()
    s.start_node()
    try:
        s.ready(t0)
        yield s
        with Client(s.url) as c:
            for info in c.list():
                c.get(info.id).destroy()
    finally:
        s.stop()
    assert_clean(s.node_state)


def _trajectory(sb: Sandbox) -> list[object]:
    return [sb.exec(APPEND).stdout, sb.files.write("/root/f", b"f").size, sb.spawn("true").id]


def test_log_survives_a_killed_node_agent_and_a_restarted_control_plane(split: Split) -> None:
    with Client(split.url) as client:
        sb = client.create(image=BUSYBOX_IMAGE, memory_mb=128)
        first = _trajectory(sb)
        before = [e.model_dump() for e in sb.log()]
        assert len(before) == 3

        # the node agent dies (SIGKILL) and comes back: it adopts the box and its log
        split.kill(split.node)
        t0 = time.time()
        split.start_node()
        split.ready(t0)
        assert [e.model_dump() for e in sb.log()] == before
        again = client.attach(sb.id, resume_from_log=True)
        assert _trajectory(again) == first and _count(client, sb.id) == 1
        assert again.exec(APPEND).stdout == b"2\n"  # step 3, appended after the restart

        # the control plane dies (SIGKILL) and comes back
        split.kill(split.cp)
        t0 = time.time()
        split.start_cp()
        split.ready(t0)
        log = sb.log()
        assert [e.model_dump() for e in log[:3]] == before and len(log) == 4
        # the node answers re-issued calls itself (a handle that fetched nothing)
        r = _raw(split.url, "POST", f"/v1/sandboxes/{sb.id}/exec", 3, json={"cmd": APPEND})
        assert r.headers[REPLAYED_HEADER] == "1" and r.json()["stdout"] == "Mgo="
        resumed = client.attach(sb.id)
        assert resumed.step == 4 and resumed.exec(APPEND).stdout == b"3\n"
        assert _count(client, sb.id) == 3


DRIVER = """
import sys
from sandfleet.sdk import Client
with Client(sys.argv[1]) as client:
    sb = client.attach(sys.argv[2])
    print("started", flush=True)
    sb.exec("sleep 2; echo once >> /root/count", timeout_s=30)
"""


def test_a_call_in_flight_when_its_driver_dies_runs_once(
    client: Client, dep: LocalDeployment
) -> None:
    """A preempted trainer cannot say whether it meant to stop its call: the call runs
    to its end and is logged, and the next driver, re-issuing it, gets its result."""
    sb = client.create(image=BUSYBOX_IMAGE, memory_mb=128)
    with subprocess.Popen(
        [sys.executable, "-c", DRIVER, dep.url, sb.id], stdout=subprocess.PIPE, text=True
    ) as driver:
        assert driver.stdout is not None and driver.stdout.readline().strip() == "started"
        time.sleep(1.0)  # the exec is running on the node
        driver.kill()
    again = client.attach(sb.id, resume_from_log=True)
    result = again.exec("sleep 2; echo once >> /root/count", timeout_s=30)
    assert result.ok and result.replayed  # waited for the first run, not a second one
    assert sb.files.read("/root/count") == b"once\n"
    assert [e.step for e in again.log()] == [0]


def test_an_exec_cut_short_by_a_node_agent_death_is_never_run_again(split: Split) -> None:
    """The in-sandbox agent kills a command whose node agent died: the step is logged
    as what it was (killed), so neither the caller nor a successor runs it again."""
    with Client(split.url) as client:
        sb = client.create(image=BUSYBOX_IMAGE, memory_mb=128)
        cmd = "echo start >> /root/side; sleep 4; echo end >> /root/side"
        running = threading.Thread(target=lambda: _swallow(lambda: sb.exec(cmd, timeout_s=30)))
        running.start()
        time.sleep(1.5)
        split.kill(split.node)
        running.join()
        t0 = time.time()
        split.start_node()
        split.ready(t0)
        again = client.attach(sb.id, resume_from_log=True)
        result = again.exec(cmd, timeout_s=30)
        assert result.replayed and result.status == "signaled" and result.signal == 9
        assert b"node agent stopped" in result.stderr
        assert sb.files.read("/root/side") == b"start\n"  # once, and cut short
        assert sb.exec("echo next").stdout == b"next\n"  # the caller's handle goes on


def _swallow(call: Callable[[], object]) -> None:
    with contextlib.suppress(errors.SandfleetError):
        call()


def test_a_call_cancelled_on_its_way_does_not_hold_up_the_ones_after_it(
    dep: LocalDeployment,
) -> None:
    async def main() -> None:
        async with AsyncClient(dep.url) as aclient:
            sb = await aclient.create(image=BUSYBOX_IMAGE, memory_mb=128)
            calls = [asyncio.ensure_future(sb.exec(f"sleep 0.5; echo {i}")) for i in range(4)]
            calls[1].cancel()  # before its request can reach the node
            started = time.monotonic()
            done = await asyncio.gather(*calls, return_exceptions=True)
            assert isinstance(done[1], asyncio.CancelledError)
            assert [r.stdout for r in done if not isinstance(r, BaseException)] == [
                b"0\n",
                b"2\n",
                b"3\n",
            ]
            after = await sb.exec("echo after", timeout_s=10)
            assert after.stdout == b"after\n"
            assert time.monotonic() - started < 10  # not the 30 s grace of a gap
            await sb.destroy()

    asyncio.run(main())


def test_an_exec_cut_short_by_a_crash_of_up_is_never_run_again(
    tmp_path: Path, images_dir: Path
) -> None:
    state = tmp_path / "state"
    dep = LocalDeployment(state, images_dir).start()
    with Client(dep.url) as client:
        sb = client.create(image=BUSYBOX_IMAGE, memory_mb=128)
        cmd = "sleep 5; echo done >> /root/count"
        running = threading.Thread(target=lambda: _swallow(lambda: sb.exec(cmd, timeout_s=30)))
        running.start()
        time.sleep(1.5)
        dep.kill()  # `up` dies; its node agent is told by SIGHUP and stops at once
        running.join()
    again = LocalDeployment(state, images_dir)
    again.node_id = dep.node_id
    with again, Client(again.url) as client:
        resumed = client.attach(sb.id, resume_from_log=True)
        result = resumed.exec(cmd, timeout_s=30)
        assert result.replayed and result.status == "signaled" and result.signal == 9, result
        assert client.get(sb.id).exec("cat /root/count 2>/dev/null; true").stdout == b""
    assert_clean(state)
