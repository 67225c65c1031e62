"""The in-sandbox agent (agent.c) and its async client, against the real binary.

The agent runs as an ordinary process (a child subreaper) on a socket in a
fresh directory; one test runs it as PID 1 of a new PID namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from sandfleet.guest.build import agent_binary
from sandfleet.guest.client import AgentClient
from sandfleet.wire.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from sandfleet.wire.models import ExecRequest, ProcessInfo, SpawnRequest

T = TypeVar("T")
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def procs() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, state) of every process on the host."""
    out: dict[int, tuple[int, str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            data = Path(f"/proc/{name}/stat").read_bytes()
        except OSError:
            continue
        fields = data[data.rindex(b")") + 2 :].split()
        out[int(name)] = (int(fields[1]), fields[0].decode())
    return out


def descendants(root: int) -> dict[int, str]:
    """pid -> state of every descendant of ``root``."""
    table = procs()
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, state) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = state
                frontier.append(pid)
    return found


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def wait_gone(pid: int, within_s: float) -> bool:
    """True once ``pid`` no longer exists (reaped), polling up to ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):
            return True
        time.sleep(0.02)
    return not os.path.exists(f"/proc/{pid}")


@dataclass
class Agent:
    proc: subprocess.Popen[bytes]
    client: AgentClient
    sock: Path
    workdir: Path


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return data[data.rindex(b")") + 2 :].split()[0] != b"Z"


def _start(env: dict[str, str] | None = None, prefix: list[str] | None = None) -> Agent:
    # short directory: Unix socket paths are limited to 107 bytes
    workdir = Path(tempfile.mkdtemp(prefix="sfa-", dir="/tmp"))
    sock = workdir / "agent.sock"
    proc = subprocess.Popen(
        [*(prefix or []), str(agent_binary()), "--socket", str(sock), "--workdir", str(workdir)],
        env=env,
    )
    client = AgentClient(sock)
    run(client.wait_ready(5.0))
    return Agent(proc, client, sock, workdir)


def _stop(agent: Agent) -> None:
    before = descendants(agent.proc.pid)
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(10) == 0
    assert not agent.sock.exists(), "agent left its socket behind"
    assert not Path(f"/tmp/.sandfleet-run.{agent.proc.pid}").exists(), "run dir left behind"
    leftover = [pid for pid in before if not wait_gone(pid, 2.0)]
    shutil.rmtree(agent.workdir, ignore_errors=True)
    assert not leftover, f"processes survived the agent: {leftover}"


@pytest.fixture
def agent() -> Iterator[Agent]:
    a = _start()
    try:
        yield a
    finally:
        _stop(a)


def test_binary_is_static_and_small() -> None:
    path = agent_binary()
    assert path.stat().st_size < 300_000
    out = subprocess.run(["file", "-L", str(path)], capture_output=True, text=True, check=False)
    if out.returncode == 0:
        assert "statically linked" in out.stdout or "static-pie" in out.stdout


def test_ping_and_idle_rss(agent: Agent) -> None:
    info = run(agent.client.ping())
    assert info == {"version": "0.1.0", "pid": agent.proc.pid}
    assert rss_kib(agent.proc.pid) < 512, "idle agent must stay well under 1 MiB"


def test_socket_is_private_and_stale_file_replaced(tmp_path: Path) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="sfa-", dir="/tmp"))
    sock = workdir / "agent.sock"
    sock.write_bytes(b"stale")
    proc = subprocess.Popen([str(agent_binary()), "--socket", str(sock)])
    a = Agent(proc, AgentClient(sock), sock, workdir)
    try:
        run(a.client.wait_ready(5.0))
        st = sock.stat()
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
    finally:
        _stop(a)


def test_listen_fd_from_the_node() -> None:
    """The node may create the socket itself and hand it over as an fd."""
    import socket

    workdir = Path(tempfile.mkdtemp(prefix="sfa-", dir="/tmp"))
    sock = workdir / "node-side.sock"
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(str(sock))
    lsock.listen(64)
    fd = lsock.fileno()
    proc = subprocess.Popen([str(agent_binary()), "--listen-fd", str(fd)], pass_fds=[fd])
    lsock.close()
    a = Agent(proc, AgentClient(sock), sock, workdir)
    try:
        run(a.client.wait_ready(5.0))
        assert run(a.client.exec(ExecRequest(cmd=["echo", "via fd"]))).stdout == b"via fd\n"
    finally:
        sock.unlink()  # the node owns the socket file in this mode
        _stop(a)


# --------------------------------------------------------------------------- K1, K4


def test_k1_output_is_bytes(agent: Agent) -> None:
    r = run(agent.client.exec(ExecRequest(cmd="printf '\\342'")))
    assert r.stdout == b"\xe2"
    assert r.stdout_text == "\ufffd"
    r = run(agent.client.exec(ExecRequest(cmd=["printf", "a\\0b\\0"])))
    assert r.stdout == b"a\0b\0"


def test_k4_exit_statuses(agent: Agent) -> None:
    c = agent.client
    r = run(c.exec(ExecRequest(cmd=["no-such-command-xyz", "arg"])))
    assert (r.status, r.exit_code) == ("exited", 127)
    assert b"no-such-command-xyz" in r.stderr and b"not found" in r.stderr
    r = run(c.exec(ExecRequest(cmd="no-such-command-xyz")))
    assert (r.exit_code, b"not found" in r.stderr) == (127, True)
    assert run(c.exec(ExecRequest(cmd="exit 3"))).exit_code == 3
    assert run(c.exec(ExecRequest(cmd=["false"]))).exit_code == 1
    r = run(c.exec(ExecRequest(cmd="kill -9 $$")))
    assert (r.status, r.signal, r.exit_code) == ("signaled", 9, None)


# --------------------------------------------------------------------------- K2


def test_k2_timeout_kills_whole_group_and_keeps_output(agent: Agent) -> None:
    t0 = time.monotonic()
    r = run(
        agent.client.exec(ExecRequest(cmd="echo line; sleep 10 & echo $!; wait", timeout_s=1.0))
    )
    elapsed = time.monotonic() - t0
    assert r.status == "timeout" and r.exit_code is None
    assert 0.9 <= elapsed < 2.5 and 0.9 <= r.duration_s < 1.5
    line, pid = r.stdout.split(b"\n")[:2]
    assert line == b"line"
    assert wait_gone(int(pid), 1.0), "the background sleep outlived the timeout"


def test_k2_argv_sleep_times_out(agent: Agent) -> None:
    t0 = time.monotonic()
    r = run(agent.client.exec(ExecRequest(cmd=["sleep", "10"], timeout_s=1.0)))
    assert r.status == "timeout" and time.monotonic() - t0 < 2.5
    # The handler reaped the killed sleep before answering; the handler itself
    # exits right after its answer (give it a moment on a busy host): nothing is left.
    deadline = time.monotonic() + 2.0
    while (left := descendants(agent.proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == {}


def test_k2_stdin_is_empty_unless_given(agent: Agent) -> None:
    t0 = time.monotonic()
    cat = run(agent.client.exec(ExecRequest(cmd=["cat"], timeout_s=5)))
    grep = run(agent.client.exec(ExecRequest(cmd=["grep", "x"], timeout_s=5)))
    assert time.monotonic() - t0 < 2.0
    assert (cat.status, cat.exit_code, cat.stdout) == ("exited", 0, b"")
    assert (grep.status, grep.exit_code) == ("exited", 1)
    data = os.urandom(3 << 20)
    assert run(agent.client.exec(ExecRequest(cmd=["cat"], stdin=data))).stdout == data
    # a command that never reads a big stdin still finishes at once
    r = run(agent.client.exec(ExecRequest(cmd=["true"], stdin=data, timeout_s=5)))
    assert r.ok


def test_k2_hung_command_does_not_block_others(agent: Agent) -> None:
    (agent.workdir / "f.txt").write_bytes(b"content")

    async def scenario() -> None:
        c = agent.client
        hung = asyncio.create_task(c.exec(ExecRequest(cmd="sleep infinity", timeout_s=3)))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        await c.ping()
        assert (await c.exec(ExecRequest(cmd="echo ok"))).stdout == b"ok\n"
        assert b"".join([x async for x in c.read_file(str(agent.workdir / "f.txt"))]) == b"content"
        assert time.monotonic() - t0 < 0.5
        assert not hung.done()
        r = await hung
        assert r.status == "timeout"
        assert (await c.exec(ExecRequest(cmd="echo again"))).stdout == b"again\n"

    run(scenario())


def test_client_going_away_kills_command(agent: Agent) -> None:
    pids: list[int] = []

    async def scenario() -> None:
        got = asyncio.Event()

        def on_out(chunk: bytes) -> None:
            pids.extend(int(x) for x in chunk.split())
            got.set()

        task = asyncio.create_task(
            agent.client.exec(
                ExecRequest(cmd="(setsid sleep 30 & echo $!); echo $$; exec sleep 30"),
                on_stdout=on_out,
            )
        )
        await asyncio.wait_for(got.wait(), 5)
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(scenario())
    assert len(pids) == 2
    assert all(wait_gone(pid, 2.0) for pid in pids), "a setsid grandchild outlived its caller"


# --------------------------------------------------------------------------- K3


def test_k3_background_children_reaped(agent: Agent) -> None:
    async def scenario() -> float:
        slowest = 0.0
        for _ in range(200):
            t0 = time.monotonic()
            r = await agent.client.exec(ExecRequest(cmd="sleep 1 &", timeout_s=5))
            slowest = max(slowest, time.monotonic() - t0)
            assert r.ok
        return slowest

    slowest = run(scenario())
    # Far from the child's 1 s, so a loaded host cannot make it flaky.
    assert slowest < 0.5, f"an exec waited for its background child ({slowest:.3f} s)"
    time.sleep(3.0)
    zombies = [pid for pid, st in descendants(agent.proc.pid).items() if st == "Z"]
    assert zombies == []
    assert run(agent.client.exec(ExecRequest(cmd="echo ok"))).stdout == b"ok\n"


def test_background_job_survives_writing_after_exec_returned(agent: Agent) -> None:
    marker = agent.workdir / "alive"
    cmd = f"(sleep 0.3; echo late; echo late >&2; echo yes > '{marker}') &"
    r = run(agent.client.exec(ExecRequest(cmd=cmd)))
    assert r.ok and r.duration_s < 0.2
    deadline = time.monotonic() + 3
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.read_text() == "yes\n", "background job died writing to its stdout"


# --------------------------------------------------------------------------- process trees


def test_timeout_kills_escaped_and_term_ignoring_processes(agent: Agent) -> None:
    # a setsid grandchild (own session and group), a double-forked one, and one
    # that ignores SIGTERM: none is in the command's process group
    cmd = (
        "setsid sleep 100 & echo $!; "
        "(setsid sh -c 'sleep 101 & echo $!' &); "
        "(trap '' TERM; exec sleep 102) & echo $!; wait"
    )
    r = run(agent.client.exec(ExecRequest(cmd=cmd, timeout_s=1.0)))
    assert r.status == "timeout"
    pids = [int(x) for x in r.stdout.split()]
    assert len(pids) == 3
    assert all(wait_gone(pid, 1.0) for pid in pids), [p for p in pids if alive(p)]


def test_timeout_grace_sends_sigterm_first(agent: Agent) -> None:
    # the main process handles SIGTERM; its TERM-ignoring child is SIGKILLed
    cmd = "(trap '' TERM; exec sleep 100) & echo $!; trap 'echo got-term; exit 0' TERM; wait"
    t0 = time.monotonic()
    r = run(agent.client.exec(ExecRequest(cmd=cmd, timeout_s=0.5, kill_grace_ms=2000)))
    assert r.status == "timeout" and time.monotonic() - t0 < 2.0
    pid, said = r.stdout.split()
    assert said == b"got-term"
    assert wait_gone(int(pid), 1.0)
    # nothing handles SIGTERM: SIGKILL comes at the end of the grace period
    t0 = time.monotonic()
    r = run(
        agent.client.exec(
            ExecRequest(cmd="trap '' TERM; sleep 100", timeout_s=0.3, kill_grace_ms=400)
        )
    )
    elapsed = time.monotonic() - t0
    assert r.status == "timeout" and 0.6 < elapsed < 1.5


def test_background_server_survives_finished_exec(agent: Agent) -> None:
    import socket
    import sys
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (agent.workdir / "hello.txt").write_text("served")
    cmd = f"{sys.executable} -m http.server --bind 127.0.0.1 {port} >/dev/null 2>&1 & echo $!"
    r = run(agent.client.exec(ExecRequest(cmd=cmd, cwd=str(agent.workdir))))
    assert r.ok and r.duration_s < 0.5
    pid = int(r.stdout)
    body = b""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/hello.txt", timeout=2) as resp:
                body = resp.read()
            break
        except OSError:
            time.sleep(0.1)
    assert body == b"served", "the background server died with its exec"
    assert alive(pid) and pid in descendants(agent.proc.pid)
    os.kill(pid, signal.SIGKILL)
    assert wait_gone(pid, 2.0), "the agent did not reap the killed server"


# --------------------------------------------------------------------------- users


def test_exec_as_user(agent: Agent) -> None:
    c = agent.client
    r = run(
        c.exec(ExecRequest(cmd='id -u; id -g; id -G; echo "$HOME $USER $LOGNAME"', user="nobody"))
    )
    assert r.ok, r.stderr
    assert r.stdout.decode().splitlines() == [
        "65534",
        "65534",
        "65534",
        "/nonexistent nobody nobody",
    ]
    r = run(c.exec(ExecRequest(cmd="id -u; id -g; echo $HOME", user="1234")))
    assert r.stdout == b"1234\n1234\n/\n"
    r = run(c.exec(ExecRequest(cmd="id -u; id -g; id -G", user="1234:nogroup")))
    assert r.stdout == b"1234\n65534\n65534\n"
    r = run(c.exec(ExecRequest(cmd="id -u; id -G", user="root")))
    assert r.stdout == b"0\n0\n"
    # the request's env wins over the user's
    r = run(c.exec(ExecRequest(cmd="echo $HOME", user="nobody", env={"HOME": "/tmp"})))
    assert r.stdout == b"/tmp\n"
    with pytest.raises(InvalidArgument, match="user 'no-such-user' does not exist in the sandbox"):
        run(c.exec(ExecRequest(cmd="id", user="no-such-user")))
    with pytest.raises(InvalidArgument, match="group 'no-such-group' does not exist"):
        run(c.exec(ExecRequest(cmd="id", user="nobody:no-such-group")))
    info = run(c.spawn(SpawnRequest(cmd=["id", "-u"], user="nobody")))
    assert run(c.wait_process(info.id, 5)).exit_code == 0
    assert run(c.read_output(info.id)).data == b"65534\n"
    run(c.remove_process(info.id))


@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs setpriv (util-linux)")
def test_user_switch_without_cap_setuid_is_a_clear_error() -> None:
    # what a container without CAP_SETUID/CAP_SETGID gets
    a = _start(prefix=["setpriv", "--bounding-set=-setuid,-setgid", "--inh-caps=-all"])
    try:
        with pytest.raises(PermissionDenied, match="lacks CAP_SETUID"):
            run(a.client.exec(ExecRequest(cmd="id", user="nobody")))
        with pytest.raises(PermissionDenied, match="lacks CAP_SETUID"):
            run(a.client.spawn(SpawnRequest(cmd="id", user="nobody")))
        # its own user needs no capability
        assert run(a.client.exec(ExecRequest(cmd="id -u", user="root"))).stdout == b"0\n"
    finally:
        _stop(a)


# --------------------------------------------------------------------------- spawn


def test_spawn_outlives_its_connection_and_output_reads_by_offset(agent: Agent) -> None:
    cmd = "for i in 1 2 3; do echo $i; sleep 0.2; done; echo err >&2"
    t0 = time.monotonic()
    info = run(agent.client.spawn(SpawnRequest(cmd=cmd)))
    latency = time.monotonic() - t0
    assert latency < 0.2 and info.state == "running" and info.id.startswith("p")
    assert info.command == cmd and alive(info.pid)

    async def later() -> None:
        fresh = AgentClient(agent.sock)  # a new client: nothing is tied to the first
        await asyncio.sleep(0.1)
        first = await fresh.read_output(info.id)
        assert (first.data, first.offset, first.next_offset, first.dropped) == (b"1\n", 0, 2, 0)
        chunks = [c async for c in fresh.follow_output(info.id, "stdout", offset=2)]
        assert b"".join(c.data for c in chunks) == b"2\n3\n"
        assert chunks[0].offset == 2 and chunks[-1].next_offset == 6
        done = await fresh.wait_process(info.id, timeout_s=5)
        assert (done.state, done.exit_code, done.signal) == ("exited", 0, None)
        assert done.ended_at is not None and done.ended_at >= done.started_at
        assert (done.stdout_bytes, done.stderr_bytes) == (6, 4)
        mid = await fresh.read_output(info.id, offset=4)
        assert (mid.data, mid.offset, mid.next_offset, mid.eof) == (b"3\n", 4, 6, True)
        assert (await fresh.read_output(info.id, "stderr")).data == b"err\n"
        beyond = await fresh.read_output(info.id, offset=100)
        assert (beyond.data, beyond.next_offset) == (b"", 6)
        # following a finished process returns what is left and ends
        assert [c.data async for c in fresh.follow_output(info.id, offset=0)] == [b"1\n2\n3\n"]
        await fresh.remove_process(info.id)
        with pytest.raises(NotFound, match=info.id):
            await fresh.read_output(info.id)
        with pytest.raises(NotFound, match=info.id):
            await fresh.wait_process(info.id)

    run(later())
    assert not alive(info.pid)


def test_spawn_stdin(agent: Agent) -> None:
    c = agent.client

    async def scenario() -> None:
        info = await c.spawn(SpawnRequest(cmd=["cat"], stdin=b"first\n"))
        assert info.stdin_open
        await c.write_stdin(info.id, b"second\n")
        await c.write_stdin(info.id, os.urandom(1 << 20))  # more than a pipe holds
        chunks = [x async for x in c.follow_output(info.id, offset=0, timeout_s=0.5)]
        out = b"".join(x.data for x in chunks)
        assert out.startswith(b"first\nsecond\n") and len(out) == 13 + (1 << 20)
        assert (await c.wait_process(info.id, timeout_s=0.1)).state == "running"
        await c.close_stdin(info.id)
        done = await c.wait_process(info.id, timeout_s=5)
        assert (done.state, done.exit_code, done.stdin_open) == ("exited", 0, False)
        with pytest.raises(FailedPrecondition, match="ended"):
            await c.write_stdin(info.id, b"late")
        await c.remove_process(info.id)
        # close_stdin in the request: `sort` sees EOF after the initial stdin
        info = await c.spawn(SpawnRequest(cmd=["sort"], stdin=b"b\na\n", close_stdin=True))
        assert (await c.wait_process(info.id, 5)).exit_code == 0
        assert (await c.read_output(info.id)).data == b"a\nb\n"
        with pytest.raises(FailedPrecondition):
            await c.write_stdin(info.id, b"x")
        await c.remove_process(info.id)

    run(scenario())


def test_spawn_kill_takes_the_whole_tree(agent: Agent) -> None:
    c = agent.client
    info = run(c.spawn(SpawnRequest(cmd="setsid sleep 100 & sleep 100")))
    deadline = time.monotonic() + 5
    tree: dict[int, str] = {}
    while time.monotonic() < deadline and len(tree) < 2:
        time.sleep(0.05)
        tree = {p: s for p, s in descendants(info.pid).items() if alive(p)}
    sleeps = [info.pid, *tree]
    assert len(sleeps) == 3
    with pytest.raises(FailedPrecondition, match="still running"):
        run(c.remove_process(info.id))
    killed = run(c.kill_process(info.id))
    assert (killed.state, killed.signal, killed.exit_code) == ("killed", 9, None)
    assert all(wait_gone(p, 1.0) for p in sleeps), [p for p in sleeps if alive(p)]
    run(c.remove_process(info.id))

    # SIGTERM: delivered, the process reports how it ended
    info = run(c.spawn(SpawnRequest(cmd=["sleep", "100"])))
    run(c.kill_process(info.id, signal=15))
    done = run(c.wait_process(info.id, 5))
    assert (done.state, done.signal) == ("killed", 15)
    run(c.remove_process(info.id))

    # a background job left behind by a finished process is still reachable
    info = run(c.spawn(SpawnRequest(cmd="sleep 100 & echo $!")))
    assert run(c.wait_process(info.id, 5)).state == "exited"
    job = int(run(c.read_output(info.id)).data)
    assert alive(job)
    assert run(c.kill_process(info.id)).state == "exited"
    assert wait_gone(job, 1.0)
    run(c.remove_process(info.id))


def test_spawn_timeout_and_signaled(agent: Agent) -> None:
    c = agent.client
    info = run(c.spawn(SpawnRequest(cmd="setsid sleep 100 & echo $!; sleep 100", timeout_s=0.5)))
    done = run(c.wait_process(info.id, 5))
    assert done.state == "timeout" and done.exit_code is None
    assert 0.4 < (done.ended_at or 0) - done.started_at < 2.0
    assert wait_gone(int(run(c.read_output(info.id)).data), 1.0)
    info2 = run(c.spawn(SpawnRequest(cmd="kill -9 $$")))
    assert (run(c.wait_process(info2.id, 5)).state, run(c.wait_process(info2.id)).signal) == (
        "signaled",
        9,
    )
    for i in (info, info2):
        run(c.remove_process(i.id))


def test_spawn_output_bound_keeps_the_newest_bytes(agent: Agent) -> None:
    import sys

    size, bound = 10 << 20, 1 << 20
    # a non-repeating-at-1MiB pattern, so the kept window's position is checked
    prog = f"import sys; sys.stdout.buffer.write((bytes(range(251)) * {size // 251 + 1})[:{size}])"
    full = (bytes(range(251)) * (size // 251 + 1))[:size]
    c = agent.client
    info = run(c.spawn(SpawnRequest(cmd=[sys.executable, "-c", prog], max_output_bytes=bound)))
    assert run(c.wait_process(info.id, 30)).exit_code == 0
    out = run(c.read_output(info.id))
    assert (out.offset, out.next_offset, out.dropped, out.eof) == (
        size - bound,
        size,
        size - bound,
        True,
    )
    assert out.data == full[-bound:]
    half = run(c.read_output(info.id, offset=size - bound // 2))
    assert (half.data, half.dropped) == (full[-bound // 2 :], 0)
    assert run(c.list_processes())[0].stdout_bytes == size
    run(c.remove_process(info.id))


def test_process_list_and_errors(agent: Agent) -> None:
    c = agent.client

    async def scenario() -> None:
        assert await c.list_processes() == []
        done = await c.spawn(SpawnRequest(cmd=["true"]))
        running = await c.spawn(SpawnRequest(cmd=["sleep", "100"]))
        await c.wait_process(done.id, 5)
        listed = {p.id: p for p in await c.list_processes()}
        assert listed[done.id].state == "exited" and listed[running.id].state == "running"
        assert list(listed) == [done.id, running.id]
        assert listed[running.id].pid == running.pid
        for bad in ("p999", "x", "../agent.sock", ""):
            with pytest.raises(NotFound):
                await c.wait_process(bad)
        with pytest.raises(NotFound, match="p999"):
            await c.kill_process("p999")
        with pytest.raises(InvalidArgument, match="stream"):
            await c.read_output(done.id, stream="stdin")
        with pytest.raises(InvalidArgument, match="cwd"):
            await c.spawn(SpawnRequest(cmd=["true"], cwd="/no/such/dir"))
        # ids are never reused, also after a remove
        await c.remove_process(done.id)
        again = await c.spawn(SpawnRequest(cmd=["true"]))
        assert int(again.id[1:]) > int(running.id[1:])
        # a command that does not exist: exits 127 with a message, like exec
        missing = await c.spawn(SpawnRequest(cmd=["no-such-command-xyz"]))
        assert (await c.wait_process(missing.id, 5)).exit_code == 127
        assert b"not found" in (await c.read_output(missing.id, "stderr")).data
        await c.kill_process(running.id)
        for p in await c.list_processes():
            await c.wait_process(p.id, 5)
            await c.remove_process(p.id)
        assert await c.list_processes() == []

    run(scenario())


def test_finished_processes_are_bounded_and_pid1_stays_small(agent: Agent) -> None:
    c = agent.client

    async def scenario() -> list[ProcessInfo]:
        for i in range(66):
            info = await c.spawn(SpawnRequest(cmd=["true"]))
            assert info.id == f"p{i + 1}"
            await c.wait_process(info.id, 5)
        return await c.list_processes()

    before = rss_kib(agent.proc.pid)
    listed = run(scenario())
    # the 64 newest stay; the oldest went first
    assert [p.id for p in listed] == [f"p{i}" for i in range(3, 67)]
    assert all(p.state == "exited" for p in listed)
    # supervisors are children of the agent, not part of it
    sups = [pid for pid, (ppid, _) in procs().items() if ppid == agent.proc.pid]
    names = set()
    for pid in sups:  # a handler may exit meanwhile
        with contextlib.suppress(FileNotFoundError):
            names.add(Path(f"/proc/{pid}/comm").read_text().strip())
    assert {f"sfsup-p{i}" for i in range(3, 67)} <= names
    assert rss_kib(agent.proc.pid) <= max(before, 200), "PID 1 grew with spawns"


# --------------------------------------------------------------------------- K6


@pytest.mark.parametrize("value", ["hello world", "a\nb", "$HOME", "it's", "", "ü"])
def test_k6_env_values_arrive_exactly(agent: Agent, value: str) -> None:
    r = run(agent.client.exec(ExecRequest(cmd='printf %s "$V"', env={"V": value})))
    assert r.stdout == value.encode()
    r = run(agent.client.exec(ExecRequest(cmd=["printenv", "V"], env={"V": value})))
    assert r.stdout == value.encode() + b"\n"


def test_base_env_defaults() -> None:
    a = _start(env={"FROM_AGENT": "1"})
    try:
        r = run(a.client.exec(ExecRequest(cmd=["env"], env={"HOME": "/work"})))
        lines = set(r.stdout.decode().splitlines())
        assert {f"PATH={BASE_PATH}", "HOME=/work", "FROM_AGENT=1"} <= lines
    finally:
        _stop(a)


def test_k6_cwd(agent: Agent) -> None:
    c = agent.client
    spaced = agent.workdir / "with space"
    spaced.mkdir()
    assert run(c.exec(ExecRequest(cmd=["pwd"], cwd=str(spaced)))).stdout == f"{spaced}\n".encode()
    assert run(c.exec(ExecRequest(cmd=["pwd"], cwd="/tmp"))).stdout == b"/tmp\n"
    assert run(c.exec(ExecRequest(cmd=["pwd"]))).stdout == f"{agent.workdir}\n".encode()
    with pytest.raises(InvalidArgument, match="/no/such/dir"):
        run(c.exec(ExecRequest(cmd=["pwd"], cwd="/no/such/dir")))
    (agent.workdir / "file").write_text("x")
    with pytest.raises(InvalidArgument, match="file"):
        run(c.exec(ExecRequest(cmd=["pwd"], cwd=str(agent.workdir / "file"))))


# --------------------------------------------------------------------------- output


def test_output_cap_keeps_head_and_tail_and_agent_stays_small(agent: Agent) -> None:
    peak = {"main": 0, "handler": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for pid in [agent.proc.pid, *descendants(agent.proc.pid)]:
                try:
                    name = Path(f"/proc/{pid}/comm").read_text().strip()
                    kib = rss_kib(pid)
                except (OSError, AssertionError):
                    continue
                if name.startswith("sandfleet-agent"):
                    key = "main" if pid == agent.proc.pid else "handler"
                    peak[key] = max(peak[key], kib)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        r = run(agent.client.exec(ExecRequest(cmd="yes | head -c 50M", max_output_bytes=1 << 20)))
    finally:
        stop.set()
        sampler.join()
    assert r.ok
    assert len(r.stdout) == 1 << 20
    assert r.stdout_dropped == 50 * (1 << 20) - (1 << 20)
    assert r.stdout == b"y\n" * (1 << 19)
    assert peak["main"] < 512
    # the handler holds at most the 512 KiB tail ring plus its buffers
    assert 0 < peak["handler"] < 2048

    # head and tail are the right bytes of a non-repeating stream
    r = run(agent.client.exec(ExecRequest(cmd=["seq", "1", "200000"], max_output_bytes=1001)))
    full = "".join(f"{i}\n" for i in range(1, 200001)).encode()
    assert r.stdout == full[:501] + full[-500:]
    assert r.stdout_dropped == len(full) - 1001
    r = run(agent.client.exec(ExecRequest(cmd="echo out; echo err >&2", max_output_bytes=0)))
    assert (r.stdout, r.stderr, r.stdout_dropped, r.stderr_dropped) == (b"", b"", 4, 4)


def test_streaming_callbacks_get_chunks_before_the_end(agent: Agent) -> None:
    seen: list[tuple[float, bytes]] = []
    errs: list[bytes] = []

    async def on_err(chunk: bytes) -> None:
        errs.append(chunk)

    async def scenario() -> float:
        r = await agent.client.exec(
            ExecRequest(cmd="echo one; echo e >&2; sleep 1; echo two"),
            on_stdout=lambda b: seen.append((time.monotonic(), b)),
            on_stderr=on_err,
        )
        assert r.stdout == b"one\ntwo\n"
        return time.monotonic()

    end = run(scenario())
    assert seen[0][1] == b"one\n" and end - seen[0][0] > 0.8
    assert b"".join(errs) == b"e\n"


# --------------------------------------------------------------------------- K7, files


def test_k7_round_trip(agent: Agent) -> None:
    c = agent.client

    async def read(path: str) -> bytes:
        return b"".join([chunk async for chunk in c.read_file(path)])

    async def scenario() -> None:
        for name, data in (("random.bin", os.urandom(1 << 20)), ("empty", b"")):
            path = str(agent.workdir / name)
            entry = await c.write_file(path, data, mode=0o600)
            assert (entry.type, entry.size, entry.mode, entry.name) == (
                "file",
                len(data),
                0o600,
                name,
            )
            assert await read(path) == data
            assert Path(path).read_bytes() == data

        async def pieces() -> AsyncIterator[bytes]:
            for i in range(5):
                yield bytes([i]) * 100_000

        path = str(agent.workdir / "dir ü" / "файл")
        await c.mkdir(str(agent.workdir / "dir ü"))
        await c.write_file(path, pieces())
        assert await read(path) == b"".join(bytes([i]) * 100_000 for i in range(5))
        names = {e.name: e for e in await c.list_dir(str(agent.workdir / "dir ü"))}
        assert names["файл"].path == path and names["файл"].size == 500_000

    run(scenario())


def test_write_is_atomic(agent: Agent) -> None:
    target = agent.workdir / "target"
    target.write_bytes(b"old")
    c = agent.client

    async def scenario() -> None:
        halfway = asyncio.Event()
        proceed = asyncio.Event()

        async def slow() -> AsyncIterator[bytes]:
            yield b"n" * (1 << 20)
            halfway.set()
            await proceed.wait()
            yield b"n" * (1 << 20)

        writer = asyncio.create_task(c.write_file(str(target), slow()))
        await halfway.wait()
        await asyncio.sleep(0.1)
        assert target.read_bytes() == b"old"  # readers never see a half-written file
        proceed.set()
        assert (await writer).size == 2 << 20
        assert target.read_bytes() == b"n" * (2 << 20)

        # an upload abandoned half way leaves the old file and no temp file
        halfway.clear()
        proceed.clear()
        writer = asyncio.create_task(c.write_file(str(target), slow()))
        await halfway.wait()
        writer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writer

    run(scenario())
    time.sleep(0.2)
    assert target.read_bytes() == b"n" * (2 << 20)
    assert sorted(p.name for p in agent.workdir.iterdir()) == ["agent.sock", "target"]


def test_file_errors_and_metadata(agent: Agent) -> None:
    c = agent.client
    w = agent.workdir

    async def read(path: str) -> bytes:
        return b"".join([chunk async for chunk in c.read_file(path)])

    async def scenario() -> None:
        with pytest.raises(NotFound, match="/missing"):
            await read(str(w / "missing"))
        with pytest.raises(InvalidArgument, match="directory"):
            await read(str(w))
        with pytest.raises(NotFound, match="nodir"):
            await c.write_file(str(w / "nodir" / "f"), b"x")
        with pytest.raises(InvalidArgument, match="is a directory"):
            await c.write_file(str(w), b"x")
        await c.mkdir(str(w / "a" / "b" / "c"))
        assert (await c.mkdir(str(w / "a"), parents=True)).type == "dir"
        with pytest.raises(InvalidArgument, match="exists"):
            await c.mkdir(str(w / "a"), parents=False)
        with pytest.raises(NotFound):
            await c.mkdir(str(w / "x" / "y"), parents=False)
        await c.write_file(str(w / "a" / "f"), b"12345")
        with pytest.raises(InvalidArgument, match="recursive=True"):
            await c.remove(str(w / "a"))
        with pytest.raises(InvalidArgument):
            await c.list_dir(str(w / "a" / "f"))
        os.symlink("/etc", w / "link")
        st = await c.stat(str(w / "link"))
        assert (st.type, st.name) == ("symlink", "link")
        f = await c.stat(str(w / "a" / "f"))
        assert (f.type, f.size, f.path) == ("file", 5, str(w / "a" / "f"))
        assert abs(f.mtime - (w / "a" / "f").stat().st_mtime) < 1e-3
        await c.remove(str(w / "link"))  # removes the link, not /etc
        assert Path("/etc").is_dir() and not (w / "link").exists()
        await c.remove(str(w / "a"), recursive=True)
        assert not (w / "a").exists()
        with pytest.raises(NotFound):
            await c.remove(str(w / "a"))
        with pytest.raises(InvalidArgument, match="NUL"):
            await c.stat("bad\0path")

    run(scenario())


# --------------------------------------------------------------------------- client


def test_client_unavailable_and_deadlines(tmp_path: Path) -> None:
    gone = AgentClient(tmp_path / "nothing.sock")
    with pytest.raises(Unavailable, match="does not exist"):
        run(gone.ping())
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        run(gone.wait_ready(0.3))
    assert time.monotonic() - t0 < 1.0

    # an agent that accepts and then never answers: the safety deadline fires
    async def scenario() -> None:
        sock = str(tmp_path / "mute.sock")
        held: list[asyncio.StreamWriter] = []

        async def accept_and_hang(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            held.append(w)

        server = await asyncio.start_unix_server(accept_and_hang, path=sock)
        async with server:
            mute = AgentClient(sock, margin_s=0.2, io_timeout_s=0.3)
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded, match="margin"):
                await mute.exec(ExecRequest(cmd="true", timeout_s=0.3))
            with pytest.raises(DeadlineExceeded):
                await mute.stat("/")
            assert time.monotonic() - t0 < 2.0
            for w in held:
                w.close()
                await w.wait_closed()

    run(scenario())


def test_agent_dying_mid_call_is_unavailable(agent: Agent) -> None:
    async def scenario() -> None:
        task = asyncio.create_task(agent.client.exec(ExecRequest(cmd="sleep 30", timeout_s=60)))
        await asyncio.sleep(0.3)
        handlers = [
            pid
            for pid, (ppid, _) in procs().items()
            if ppid == agent.proc.pid
            and Path(f"/proc/{pid}/comm").read_text().startswith("sandfleet-agent")
        ]
        assert len(handlers) == 1
        os.kill(handlers[0], signal.SIGKILL)
        with pytest.raises(Unavailable, match="died or was killed"):
            await task

    run(scenario())


# --------------------------------------------------------------------------- PID 1


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root")
def test_as_pid1_reaps_orphans_and_stops_on_sigterm() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="sfa-", dir="/tmp"))
    sock = workdir / "agent.sock"
    # on the host's filesystem: a run dir of its own, not the host's /run/sandfleet
    rundir = workdir / "run"
    proc = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            str(agent_binary()),
            "--socket",
            str(sock),
            "--run-dir",
            str(rundir),
        ]
    )
    client = AgentClient(sock)
    try:
        run(client.wait_ready(5.0))
        assert run(client.ping())["pid"] == 1
        pid1 = next(pid for pid, (ppid, _) in procs().items() if ppid == proc.pid)
        assert stat.S_IMODE(rundir.stat().st_mode) == 0o700

        async def spawns() -> None:
            for _ in range(20):
                info = await client.spawn(SpawnRequest(cmd="echo hi; sleep 0.05 &"))
                assert info.pid > 1
                assert (await client.wait_process(info.id, 5)).exit_code == 0
                assert (await client.read_output(info.id)).data == b"hi\n"
            listed = await client.list_processes()
            assert len(listed) == 20 and {p.state for p in listed} == {"exited"}
            for p in listed[:10]:
                await client.remove_process(p.id)

        run(spawns())
        time.sleep(0.3)
        assert rss_kib(pid1) < 512, "PID 1 grew with spawns"
        # the ten kept supervisors are PID 1's children, not PID 1
        sups = [p for p, (pp, _) in procs().items() if pp == pid1 and p != pid1]
        assert sum(Path(f"/proc/{p}/comm").read_text().startswith("sfsup-") for p in sups) == 10

        async def orphans() -> None:
            for _ in range(30):
                # double fork: the sleep's parent exits, so it is re-parented to PID 1
                r = await client.exec(ExecRequest(cmd="(sleep 0.1 &) ; sleep 0.1 &"))
                assert r.ok

        run(orphans())
        time.sleep(1.5)
        r = run(client.exec(ExecRequest(cmd="cat /proc/[0-9]*/stat")))
        states = [line.rsplit(b")", 1)[1].split()[0] for line in r.stdout.splitlines()]
        assert b"Z" not in states
        r = run(client.exec(ExecRequest(cmd="echo $$; sleep 100 & sleep 0.05")))
        assert r.ok and int(r.stdout) > 1
        running = run(client.spawn(SpawnRequest(cmd="sleep 100")))
        assert run(client.wait_process(running.id, 0)).state == "running"
        kids = descendants(proc.pid)
        # 10 kept supervisors, the new one and its sleep, the exec's background sleep
        assert len([k for k in kids if alive(k)]) >= 13
        os.kill(pid1, signal.SIGTERM)
        assert proc.wait(10) == 0
        assert all(wait_gone(pid, 2.0) for pid in kids)
        assert list(rundir.iterdir()) == [], "sockets of killed supervisors left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


# --------------------------------------------------------------------------- build


def test_agent_binary_builds_into_cache_keyed_by_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandfleet.guest import build

    monkeypatch.setattr(build, "PACKAGED_BINARY", tmp_path / "missing" / "sandfleet-agent")
    monkeypatch.setenv("SANDFLEET_CACHE_DIR", str(tmp_path / "cache"))
    first = build.agent_binary()
    assert first.parent == tmp_path / "cache" and first.name.startswith("sandfleet-agent-")
    out = subprocess.run([str(first), "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "sandfleet-agent 0.1.0"
    mtime = first.stat().st_mtime_ns
    assert build.agent_binary() == first and first.stat().st_mtime_ns == mtime


def test_agent_binary_without_compiler_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandfleet.guest import build
    from sandfleet.wire.errors import FailedPrecondition

    monkeypatch.setattr(build, "PACKAGED_BINARY", tmp_path / "missing" / "sandfleet-agent")
    monkeypatch.setenv("SANDFLEET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "find_compiler", lambda: None)
    with pytest.raises(FailedPrecondition, match="musl-tools"):
        build.agent_binary()


def test_commands_lose_the_agents_id_switching_caps(agent: Agent) -> None:
    """The agent may switch users; the commands it runs must not (CapEff without bits 6, 7)."""
    r = run(
        agent.client.exec(ExecRequest(cmd=["grep", "-E", "^Cap(Prm|Eff):", "/proc/self/status"]))
    )
    for line in r.stdout.decode().splitlines():
        caps = int(line.split()[1], 16)
        assert caps & (1 << 6 | 1 << 7) == 0, line
    nnp = run(agent.client.exec(ExecRequest(cmd=["grep", "NoNewPrivs", "/proc/self/status"])))
    assert nnp.stdout.split()[-1] == b"1"
