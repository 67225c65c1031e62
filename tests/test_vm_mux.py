"""The VM agent mux: the real agent in guest mode (``--vport-fd``) behind AgentMux.

No VM: the agent runs as an ordinary process whose "virtio-serial port" is one
end of a socketpair. :class:`FakeChardev` plays QEMU's part: a Unix socket
server (one client at a time) relaying to the other end, dropping what the
guest writes while no client is connected, as QEMU's socket chardev does.
What it cannot show is a real port's POLLHUP while the host is away, so a
reconnect here is the harder case: the guest never learns the host left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sandfleet.backends.vm.mux import WINDOW, AgentMux, Hello
from sandfleet.guest.build import agent_binary
from sandfleet.guest.client import AgentClient
from sandfleet.wire.errors import FailedPrecondition, Unavailable
from sandfleet.wire.models import ExecRequest, SpawnRequest
from tests.test_guest_agent import descendants, run, wait_gone

AGENT_CAPS = 1 << 29 | 1 << 5 | 1 << 10 | 1 << 6 | 1 << 7
ROOT = os.geteuid() == 0


class FakeChardev:
    """QEMU's socket chardev for a port whose guest side is ``guest_peer``."""

    def __init__(self, path: Path, guest_peer: socket.socket) -> None:
        self.path = path
        self.guest = guest_peer
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(4)
        self.client: socket.socket | None = None
        self.connections = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._guest_to_host, daemon=True).start()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.client = conn
                self.connections += 1
            while data := _recv(conn):
                try:
                    self.guest.sendall(data)
                except OSError:
                    break
            with self._lock:
                self.client = None
            conn.close()

    def _guest_to_host(self) -> None:
        while data := _recv(self.guest):
            with self._lock:
                client = self.client
            if client is not None:  # with nobody connected, QEMU drops it
                with contextlib.suppress(OSError):
                    client.sendall(data)

    def drop_client(self) -> None:
        """As if QEMU exited: the host's connection ends."""
        with self._lock:
            if self.client is not None:
                self.client.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()
        self.drop_client()
        with contextlib.suppress(OSError):
            self.guest.shutdown(socket.SHUT_RDWR)
        self.guest.close()
        self.path.unlink(missing_ok=True)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(256 << 10)
    except OSError:
        return b""


@dataclass
class VmAgent:
    proc: subprocess.Popen[bytes]
    chardev: FakeChardev
    listen: Path
    workdir: Path
    log: Path

    def mux_pid(self) -> int:
        """The agent's mux child (``sfmux``)."""
        for pid in descendants(self.proc.pid):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().strip() == "sfmux":
                    return pid
        raise AssertionError("no mux process")

    @contextlib.asynccontextmanager
    async def session(self, hostname: str = "sf-mux-test") -> AsyncIterator[AgentMux]:
        mux = AgentMux()
        await mux.start(self.chardev.path, self.listen, hello=Hello(hostname), timeout_s=10)
        try:
            yield mux
        finally:
            await mux.close()


def start_vm_agent(extra: list[str] | None = None, as_user: int | None = None) -> VmAgent:
    """The agent in guest mode. As root it runs in a UTS namespace of its own and
    without CAP_SYS_TIME, so a hello cannot change this machine's hostname or clock;
    ``as_user`` (root only) runs it as that uid without any capability."""
    workdir = Path(tempfile.mkdtemp(prefix="sfm-", dir="/tmp"))
    guest, host = socket.socketpair()
    prefix: list[str] = []
    if ROOT:
        prefix = ["unshare", "--uts", "setpriv", "--bounding-set", "-sys_time"]
    if as_user is not None:
        os.chown(workdir, as_user, as_user)
        prefix += ["--reuid", str(as_user), "--regid", str(as_user), "--clear-groups"]
    log = workdir / "agent.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [
                *prefix,
                str(agent_binary()),
                "--vport-fd",
                str(guest.fileno()),
                "--run-dir",
                str(workdir / "run"),
                "--workdir",
                str(workdir),
                *(extra or []),
            ],
            pass_fds=[guest.fileno()],
            stderr=err,
        )
    guest.close()
    chardev = FakeChardev(workdir / "chardev.sock", host)
    return VmAgent(proc, chardev, workdir / "agent.sock", workdir, log)


def stop_vm_agent(vm: VmAgent) -> None:
    before = descendants(vm.proc.pid)
    vm.proc.send_signal(signal.SIGTERM)
    assert vm.proc.wait(10) == 0
    vm.chardev.close()
    leftover = [pid for pid in before if not wait_gone(pid, 2.0)]
    shutil.rmtree(vm.workdir, ignore_errors=True)
    assert not leftover, f"processes survived the agent: {leftover}"


@pytest.fixture
def vm() -> Iterator[VmAgent]:
    a = start_vm_agent()
    try:
        yield a
    finally:
        stop_vm_agent(a)


def test_exec_and_ping_through_the_mux(vm: VmAgent) -> None:
    async def scenario() -> None:
        async with vm.session() as mux:
            client = AgentClient(vm.listen)
            assert (await client.ping())["pid"] == vm.proc.pid
            r = await client.exec(ExecRequest(cmd=["echo", "hello"]))
            assert r.status == "exited" and r.stdout == b"hello\n"
            assert oct(vm.listen.stat().st_mode & 0o777) == "0o600"
            await asyncio.sleep(0.05)
            assert mux.active_channels() == 0

    run(scenario())


def test_stdin_to_stdout_one_mib_exactly(vm: VmAgent) -> None:
    data = os.urandom(1 << 20)

    async def scenario() -> None:
        async with vm.session():
            r = await AgentClient(vm.listen).exec(ExecRequest(cmd=["cat"], stdin=data))
            assert r.ok and r.stdout == data

    run(scenario())


def test_concurrent_execs_do_not_mix(vm: VmAgent) -> None:
    inputs = [os.urandom(100_000 + i * 7919) for i in range(20)]

    async def scenario() -> None:
        async with vm.session() as mux:
            client = AgentClient(vm.listen)
            results = await asyncio.gather(
                *(client.exec(ExecRequest(cmd=["cat"], stdin=d)) for d in inputs)
            )
            assert [r.stdout for r in results] == inputs
            await asyncio.sleep(0.05)
            assert mux.active_channels() == 0

    run(scenario())


async def _raw_exec(listen: Path, cmd: str, stdin: bytes = b"") -> tuple[Any, Any]:
    """An exec whose client reads nothing until told: a slow reader."""
    from sandfleet.guest import protocol as p

    reader, writer = await asyncio.open_unix_connection(listen)
    writer.write(p.encode_exec(ExecRequest(cmd=cmd, timeout_s=60, max_output_bytes=None)))
    for off in range(0, len(stdin), p.CHUNK):
        writer.write(p.frame(p.DATA, stdin[off : off + p.CHUNK]))
    writer.write(p.frame(p.END))
    return reader, writer


async def _raw_result(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """Reads a raw exec to its end: (stdout bytes, X payload)."""
    total = 0
    while True:
        head = await reader.readexactly(5)
        payload = await reader.readexactly(int.from_bytes(head[:4], "big"))
        if head[4:5] == b"1":
            total += len(payload)
        elif head[4:5] == b"X":
            return total, payload


def test_a_slow_reader_stalls_only_its_own_channel(vm: VmAgent) -> None:
    """32 MiB of output nobody reads, 8 MiB of stdin nobody reads: other calls go on,
    and the mux holds no more than its windows meanwhile."""

    async def scenario() -> None:
        async with vm.session():
            client = AgentClient(vm.listen)
            out_r, out_w = await _raw_exec(vm.listen, "head -c 33554432 /dev/zero")
            big = os.urandom(8 << 20)
            in_r, in_w = await _raw_exec(vm.listen, "sleep 1.5; wc -c", stdin=big)
            await asyncio.sleep(0.5)  # both stalled by now
            t0 = time.monotonic()
            for _ in range(10):
                assert (await client.exec(ExecRequest(cmd=["echo", "x"]))).stdout == b"x\n"
            assert time.monotonic() - t0 < 3.0
            rss = int(
                next(
                    line.split()[1]
                    for line in Path(f"/proc/{vm.mux_pid()}/status").read_text().splitlines()
                    if line.startswith("VmRSS:")
                )
            )
            assert rss < 2048, f"mux RSS {rss} KiB with two stalled channels"
            total, _ = await _raw_result(out_r)
            assert total == 32 << 20
            out_w.close()
            r = await client.exec(ExecRequest(cmd=["echo", "after"]))
            assert r.stdout == b"after\n"
            head = await in_r.readexactly(5)
            assert head[4:5] == b"1"
            assert int(await in_r.readexactly(int.from_bytes(head[:4], "big"))) == len(big)
            in_w.close()

    run(scenario())


def test_spawn_and_follow_output(vm: VmAgent) -> None:
    async def scenario() -> None:
        async with vm.session():
            client = AgentClient(vm.listen)
            info = await client.spawn(
                SpawnRequest(cmd="for i in 1 2 3 4 5; do echo line$i; sleep 0.1; done")
            )
            got = b""
            async for chunk in client.follow_output(info.id, timeout_s=10):
                got += chunk.data
            assert got == b"".join(b"line%d\n" % i for i in range(1, 6))
            assert (await client.wait_process(info.id, 5)).exit_code == 0

    run(scenario())


def test_write_and_read_a_5_mib_file(vm: VmAgent) -> None:
    data = os.urandom(5 << 20)

    async def scenario() -> None:
        async with vm.session():
            client = AgentClient(vm.listen)
            path = str(vm.workdir / "big.bin")
            entry = await client.write_file(path, data)
            assert entry.size == len(data)
            got = b"".join([chunk async for chunk in client.read_file(path)])
            assert got == data

    run(scenario())


def test_client_going_away_kills_the_command(vm: VmAgent) -> None:
    pids: list[int] = []

    async def scenario() -> None:
        async with vm.session() as mux:
            got = asyncio.Event()

            def on_out(chunk: bytes) -> None:
                pids.extend(int(x) for x in chunk.split())
                got.set()

            task = asyncio.create_task(
                AgentClient(vm.listen).exec(
                    ExecRequest(cmd="(setsid sleep 30 & echo $!); echo $$; exec sleep 30"),
                    on_stdout=on_out,
                )
            )
            await asyncio.wait_for(got.wait(), 5)
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):
                if not mux.active_channels():
                    break
                await asyncio.sleep(0.02)
            assert mux.active_channels() == 0

    run(scenario())
    assert len(pids) == 2
    assert all(wait_gone(pid, 2.0) for pid in pids), "the command outlived its caller"


def test_half_close_works_both_ways(vm: VmAgent) -> None:
    """A client that shuts down its writing still gets its whole answer and then EOF
    (the handler's own shutdown); a call it half-closed keeps running, as on a
    direct socket, and closing the socket later ends it."""
    from sandfleet.guest import protocol as p

    async def scenario() -> None:
        async with vm.session() as mux:
            reader, writer = await asyncio.open_unix_connection(vm.listen)
            writer.write(p.frame(p.OP_PING))
            writer.write_eof()
            head = await reader.readexactly(5)
            assert head[4:5] == p.OK
            await reader.readexactly(int.from_bytes(head[:4], "big"))
            assert await asyncio.wait_for(reader.read(), 5) == b""  # the handler's F
            writer.close()

            reader, writer = await _raw_exec(vm.listen, "sleep 0.3; echo done")
            writer.write_eof()
            total, res = await asyncio.wait_for(_raw_result(reader), 5)
            assert res[0] == 0 and total == 5  # exited, "done\n"
            writer.close()

            reader, writer = await _raw_exec(vm.listen, "echo $$; exec sleep 30")
            writer.write_eof()
            head = await reader.readexactly(5)
            pid = int(await reader.readexactly(int.from_bytes(head[:4], "big")))
            await asyncio.sleep(0.3)
            assert mux.active_channels() == 1  # half-closed: it runs on
            writer.close()
            assert await asyncio.to_thread(wait_gone, pid, 3.0), "closing did not end the call"

    run(scenario())


async def _running_exec(client: AgentClient, mux: AgentMux) -> tuple[asyncio.Task[Any], int]:
    """An exec of ``sleep 30`` in flight: its task and the sleep's pid."""
    pid = asyncio.get_running_loop().create_future()

    def on_out(chunk: bytes) -> None:
        if not pid.done():
            pid.set_result(int(chunk))

    task = asyncio.create_task(
        client.exec(ExecRequest(cmd="echo $$; exec sleep 30", timeout_s=60), on_stdout=on_out)
    )
    return task, await asyncio.wait_for(pid, 5)


def test_quiesce_refuses_open_channels_unless_forced(vm: VmAgent) -> None:
    async def scenario() -> None:
        async with vm.session() as mux:
            client = AgentClient(vm.listen)
            task, pid = await _running_exec(client, mux)
            assert mux.active_channels() == 1
            with pytest.raises(FailedPrecondition, match="force=True"):
                await mux.quiesce(timeout_s=5)
            await mux.quiesce(timeout_s=5, force=True)
            assert mux.state == "quiesced" and mux.active_channels() == 0
            with pytest.raises(Unavailable):
                await task
            assert await asyncio.to_thread(wait_gone, pid, 3.0), "the forced-out command runs on"
            t0 = time.monotonic()
            with pytest.raises(Unavailable, match="does not exist"):
                await client.ping()
            assert time.monotonic() - t0 < 0.5
            with pytest.raises(FailedPrecondition):
                await mux.quiesce(timeout_s=5)
            await mux.reconnect(Hello("after-quiesce"))
            assert (await client.exec(ExecRequest(cmd=["echo", "ok"]))).stdout == b"ok\n"
            await mux.quiesce(timeout_s=5)  # nothing open: no force needed
            await mux.reconnect(Hello("again"))
            assert (await client.ping())["pid"] == vm.proc.pid

    run(scenario())


def test_host_reconnect_starts_a_new_session(vm: VmAgent) -> None:
    """The guest here never sees the host leave (no POLLHUP on a socketpair):
    the new session's zeros and S frame bring it back in step."""

    async def scenario() -> None:
        async with vm.session("first") as mux:
            client = AgentClient(vm.listen)
            task, pid = await _running_exec(client, mux)
            await mux.reconnect(Hello("second"))
            with pytest.raises(Unavailable):
                await task
            assert await asyncio.to_thread(wait_gone, pid, 3.0)
            for _ in range(3):
                r = await client.exec(ExecRequest(cmd="hostname"))
                assert r.ok
                if ROOT:
                    assert r.stdout == b"second\n"
            assert vm.chardev.connections == 2

    run(scenario())


def test_chardev_drop_fails_calls_fast_until_reconnect(vm: VmAgent) -> None:
    async def scenario() -> None:
        async with vm.session() as mux:
            client = AgentClient(vm.listen)
            task, _ = await _running_exec(client, mux)
            vm.chardev.drop_client()  # QEMU exited
            with pytest.raises(Unavailable):
                await asyncio.wait_for(task, 5)
            for _ in range(100):
                if mux.state == "disconnected":
                    break
                await asyncio.sleep(0.01)
            assert mux.state == "disconnected" and mux.active_channels() == 0
            t0 = time.monotonic()
            with pytest.raises(Unavailable):
                await client.exec(ExecRequest(cmd=["true"]))
            assert time.monotonic() - t0 < 0.5
            with pytest.raises(FailedPrecondition):
                await mux.quiesce(timeout_s=1)
            await mux.reconnect(Hello.now("back"))
            assert (await client.exec(ExecRequest(cmd=["echo", "back"]))).stdout == b"back\n"

    run(scenario())


def test_start_errors_say_what_to_check(tmp_path: Path) -> None:
    async def scenario() -> None:
        mux = AgentMux()
        with pytest.raises(Unavailable, match="-chardev socket"):
            await mux.start(
                tmp_path / "none.sock", tmp_path / "a.sock", hello=Hello("x"), timeout_s=0.2
            )
        # a chardev whose guest never answers (no agent behind it)
        mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        mute.bind(str(tmp_path / "mute.sock"))
        mute.listen(1)
        try:
            with pytest.raises(Unavailable, match="console log"):
                await AgentMux().start(
                    tmp_path / "mute.sock", tmp_path / "a.sock", hello=Hello("x"), timeout_s=0.3
                )
        finally:
            mute.close()
        assert not (tmp_path / "a.sock").exists()
        with pytest.raises(FailedPrecondition):
            await AgentMux().reconnect(Hello("x"))

    run(scenario())


def test_a_restarted_mux_resynchronises(vm: VmAgent) -> None:
    async def scenario() -> None:
        async with vm.session() as mux:
            client = AgentClient(vm.listen)
            task, pid = await _running_exec(client, mux)
            old = vm.mux_pid()
            os.kill(old, signal.SIGKILL)
            # the new mux's zeros make the host start a new session: the call in flight
            # through the dead mux is aborted, then calls work again
            with pytest.raises(Unavailable):
                await asyncio.wait_for(task, 5)
            assert await asyncio.to_thread(wait_gone, pid, 3.0)
            deadline = time.monotonic() + 5
            while True:
                try:
                    r = await client.exec(ExecRequest(cmd=["echo", "again"], timeout_s=5))
                    break
                except Unavailable:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.1)
            assert r.stdout == b"again\n"
            assert vm.mux_pid() != old and mux.state == "active"

    run(scenario())


def test_guest_garbage_is_answered_and_resynchronised(vm: VmAgent) -> None:
    async def scenario() -> None:
        async with vm.session() as mux:
            client = AgentClient(vm.listen)
            task, _ = await _running_exec(client, mux)
            # bytes the host never sent, between two frames: the guest must not act
            # on them, and must get the host to start over
            vm.chardev.guest.sendall(b"Z" + bytes(8) + b"garbage")
            with pytest.raises(Unavailable):
                await asyncio.wait_for(task, 5)
            r = await client.exec(ExecRequest(cmd=["echo", "fine"]))
            assert r.stdout == b"fine\n"
        assert b"invalid frame 0x5a" in vm.log.read_bytes()

    run(scenario())


def test_credit_window_is_exact_at_the_frame_level(vm: VmAgent) -> None:
    """A host that acknowledges nothing gets exactly one window of data."""
    from sandfleet.backends.vm import mux as m
    from sandfleet.guest import protocol as p

    async def frames(reader: asyncio.StreamReader, idle_s: float) -> list[tuple[int, int, bytes]]:
        out = []
        with contextlib.suppress(TimeoutError):
            while True:
                head = await asyncio.wait_for(reader.readexactly(9), idle_s)
                t, c, n = m._HEADER.unpack(head)
                out.append((t, c, await reader.readexactly(n)))
        return out

    async def scenario() -> None:
        reader, writer = await asyncio.open_unix_connection(vm.chardev.path, limit=1 << 20)
        writer.write(m._PAD + m._SYNC + m._frame(b"H", 0, Hello("raw").payload()))
        await m._skip_to(reader, m._HELLO_ANSWER)
        request = p.encode_exec(ExecRequest(cmd="head -c 4194304 /dev/zero")) + p.frame(p.END)
        writer.write(m._frame(b"O", 7, b"") + m._frame(b"D", 7, request))
        got = await frames(reader, 0.5)
        data = sum(len(pl) for t, c, pl in got if t == ord("D") and c == 7)
        assert data == WINDOW
        assert max(len(pl) for _, _, pl in got) <= m.MAX_PAYLOAD
        assert {t for t, _, _ in got} <= {ord("D"), ord("A")}
        writer.write(m._frame(b"A", 7, (WINDOW // 2).to_bytes(4, "big")))
        got = await frames(reader, 0.5)
        assert sum(len(pl) for t, c, pl in got if t == ord("D")) == WINDOW // 2
        writer.write(m._frame(b"C", 7))  # abort: the command goes
        writer.write(m._frame(b"O", 8, b"") + m._frame(b"D", 8, p.frame(p.OP_PING)))
        writer.write(m._frame(b"F", 8))
        got = await frames(reader, 0.5)
        kinds = [chr(t) for t, c, _ in got if c == 8 and t != ord("A")]
        assert kinds[-1] == "F" and set(kinds[:-1]) == {"D"}, kinds  # the answer, then F
        answer = b"".join(pl for t, c, pl in got if c == 8 and t == ord("D"))
        assert answer[4:5] == p.OK and p.decode_fields(answer[5:])["p"] == b"%d" % vm.proc.pid
        acked = sum(int.from_bytes(pl, "big") for t, c, pl in got if c == 8 and t == ord("A"))
        assert acked == len(p.frame(p.OP_PING))
        writer.close()

    run(scenario())


def test_exec_status_oom_from_the_events_file(tmp_path: Path) -> None:
    """The agent reads ``oom_kill N`` before and after; a command that fails while it
    grows is oom. The command bumps the counter itself here (see the root test for
    a real OOM kill)."""
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n")
    os.chmod(tmp_path, 0o755)
    vm = start_vm_agent(["--oom-events", str(events)])
    bump = f"n=$(sed -n 's/^oom_kill //p' {events}); echo oom_kill $((n + 1)) > {events}"

    async def scenario() -> None:
        async with vm.session():
            client = AgentClient(vm.listen)
            r = await client.exec(ExecRequest(cmd="exit 3"))
            assert (r.status, r.exit_code) == ("exited", 3)
            r = await client.exec(ExecRequest(cmd=f"{bump}; exit 137"))
            assert (r.status, r.exit_code, r.signal) == ("oom", None, 9)
            events.write_text("oom_kill 5\n")
            r = await client.exec(ExecRequest(cmd=f"{bump}; kill -9 $$"))
            assert (r.status, r.exit_code, r.signal) == ("oom", None, 9)
            r = await client.exec(ExecRequest(cmd=f"{bump}; echo fine"))  # it succeeded
            assert (r.status, r.exit_code) == ("exited", 0)

    try:
        run(scenario())
    finally:
        stop_vm_agent(vm)


@pytest.mark.root
@pytest.mark.skipif(not ROOT, reason="needs root")
def test_exec_killed_by_a_real_memory_limit_is_oom() -> None:
    from sandfleet.backends.container.cgroups import detect_layout

    layout = detect_layout()
    rel = f"/sfmux-test-{os.getpid()}"
    cg = layout.memory_dir(rel)
    if cg is None or not shutil.which("python3"):
        pytest.skip("no memory cgroup controller or python3")
    cg.mkdir()
    vm = None
    try:
        layout.set_memory_limit(rel, 64 << 20)
        events = cg / ("memory.events" if layout.mode == "v2" else "memory.oom_control")
        vm = start_vm_agent(["--oom-events", str(events)])
        (cg / "cgroup.procs").write_text(str(vm.proc.pid))  # what it forks from now on

        async def scenario() -> None:
            async with vm.session():
                client = AgentClient(vm.listen)
                hog = "python3 -c \"x = b'a' * (512 << 20)\""
                r = await client.exec(ExecRequest(cmd=["sh", "-c", hog]))
                assert (r.status, r.exit_code, r.signal) == ("oom", None, 9), r
                r = await client.exec(ExecRequest(cmd=["sh", "-c", f"{hog}; echo $?"]))
                assert (r.status, r.stdout) == ("exited", b"137\n"), "it succeeded: not oom"
                r = await client.exec(ExecRequest(cmd=["echo", "alive"]))
                assert r.stdout == b"alive\n"

        run(scenario())
        assert layout.oom_kills(rel) >= 2
    finally:
        if vm is not None:
            stop_vm_agent(vm)
        for _ in range(50):
            with contextlib.suppress(OSError):
                cg.rmdir()
                break
            time.sleep(0.05)


@pytest.mark.root
@pytest.mark.skipif(not ROOT, reason="needs root")
def test_guest_mode_drops_to_agent_caps_and_hello_sets_the_hostname(vm: VmAgent) -> None:
    def caps(pid: int | str) -> dict[str, int]:
        text = Path(f"/proc/{pid}/status").read_text()
        return {
            k: int(v, 16)
            for k, v in (line.split(":\t") for line in text.splitlines())
            if k.startswith("Cap")
        }

    async def scenario() -> None:
        async with vm.session("sf-guest-1") as mux:
            client = AgentClient(vm.listen)
            # PID 1 drops them after forking the mux, before it serves any call
            assert (await client.exec(ExecRequest(cmd="hostname"))).stdout == b"sf-guest-1\n"
            agent = caps(vm.proc.pid)
            assert agent["CapBnd"] == agent["CapPrm"] == agent["CapEff"] == AGENT_CAPS
            assert "NoNewPrivs:\t1" in Path(f"/proc/{vm.proc.pid}/status").read_text()
            # the mux keeps what the hello needs (CAP_SYS_ADMIN: hostname, entropy)
            assert caps(vm.mux_pid())["CapEff"] & (1 << 21)
            r = await client.exec(ExecRequest(cmd=["grep", "^Cap", "/proc/self/status"]))
            command = {
                k: int(v, 16) for k, v in (ln.split(":\t") for ln in r.stdout.decode().splitlines())
            }
            assert command["CapBnd"] == AGENT_CAPS
            assert command["CapEff"] == 1 << 29 | 1 << 10  # AUDIT_WRITE, NET_BIND_SERVICE
            await mux.reconnect(Hello("sf-guest-2"))
            assert (await client.exec(ExecRequest(cmd="hostname"))).stdout == b"sf-guest-2\n"
        assert socket.gethostname() != "sf-guest-2"
        # CAP_SYS_TIME was withheld (setpriv) so the test cannot move this machine's clock
        assert b"clock not set" in vm.log.read_bytes()

    run(scenario())


@pytest.mark.root
@pytest.mark.skipif(not ROOT, reason="needs root")
def test_without_privileges_the_hello_is_skipped_gracefully() -> None:
    vm = start_vm_agent(as_user=65534)

    async def scenario() -> None:
        async with vm.session("never-set"):
            client = AgentClient(vm.listen)
            r = await client.exec(ExecRequest(cmd="id -u; hostname"))
            assert r.ok and r.stdout.split()[0] == b"65534"
            assert r.stdout.split()[1] != b"never-set"

    try:
        run(scenario())
        log = vm.log.read_bytes()
        assert b"hostname not set" in log and b"entropy not added" in log
    finally:
        stop_vm_agent(vm)
