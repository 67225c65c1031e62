"""Conformance of the newer surface: streaming exec, background processes, `user=`, `disk_mb=`.

The same cases as the rest of the suite (K1 bytes, K2 timeouts, K3 lifecycle,
K5 limits) through the newer calls, for every built kind.
"""

from __future__ import annotations

import threading
import time

import pytest

from sandfleet import errors
from sandfleet.sdk import Sandbox
from sandfleet.wire.models import ExecEvent
from tests.conformance.conftest import Fleet

pytestmark = pytest.mark.root


def _running(sandbox: Sandbox, needle: str) -> list[str]:
    ps = sandbox.exec(["ps", "-o", "pid,user,args"])
    assert ps.ok, ps
    return [line for line in ps.stdout_text.splitlines() if needle in line]


# --------------------------------------------------------------------------- streaming exec


def test_exec_callbacks_get_output_as_it_is_written(sandbox: Sandbox) -> None:
    """K1/K2 streaming: on_stdout/on_stderr see each chunk before the command ends, byte-exact."""
    seen: list[tuple[str, float, bytes]] = []
    t0 = time.monotonic()
    r = sandbox.exec(
        r"printf 'first\342'; printf 'e1\0' >&2; sleep 1.5; printf 'second'; printf 'e2' >&2",
        on_stdout=lambda b: seen.append(("out", time.monotonic() - t0, b)),
        on_stderr=lambda b: seen.append(("err", time.monotonic() - t0, b)),
        timeout_s=10,
    )
    end = time.monotonic() - t0
    assert r.ok and r.stdout == b"first\xe2second" and r.stderr == b"e1\0e2"
    assert b"".join(b for s, _, b in seen if s == "out") == r.stdout
    assert b"".join(b for s, _, b in seen if s == "err") == r.stderr
    first_out = min(t for s, t, _ in seen if s == "out")
    assert first_out < end - 1.0, (first_out, end)


def test_exec_stream_yields_output_then_the_result(sandbox: Sandbox) -> None:
    """K1/K2 streaming: exec_stream yields output events as they come and a result last."""
    events: list[tuple[float, ExecEvent]] = []
    t0 = time.monotonic()
    for event in sandbox.exec_stream("echo one; sleep 1.5; echo two >&2; exit 5", timeout_s=10):
        events.append((time.monotonic() - t0, event))
    kinds = [e.type for _, e in events]
    assert kinds[-1] == "result" and kinds.count("result") == 1
    result = events[-1][1].result
    assert result is not None and (result.status, result.exit_code) == ("exited", 5)
    assert b"".join(e.data for _, e in events if e.type == "stdout") == b"one\n"
    assert b"".join(e.data for _, e in events if e.type == "stderr") == b"two\n"
    first = next(t for t, e in events if e.type == "stdout")
    assert first < events[-1][0] - 1.0


def test_exec_stream_timeout_keeps_output_and_kills(sandbox: Sandbox) -> None:
    """K2 streaming: a streamed command past its timeout ends with a `timeout` result."""
    t0 = time.monotonic()
    events = list(sandbox.exec_stream("echo before; setsid sleep 110 & sleep 110", timeout_s=1))
    assert time.monotonic() - t0 < 3
    result = events[-1].result
    assert result is not None and result.status == "timeout" and result.exit_code is None
    assert b"".join(e.data for e in events if e.type == "stdout") == b"before\n"
    time.sleep(0.5)
    assert not _running(sandbox, "sleep 110")


def test_stopping_a_stream_early_kills_the_command(sandbox: Sandbox) -> None:
    """K2 streaming: breaking out of exec_stream kills the command's whole tree."""
    for event in sandbox.exec_stream("echo go; sleep 111 & sleep 111", timeout_s=60):
        if event.type == "stdout":
            break
    deadline = time.monotonic() + 3
    while _running(sandbox, "sleep 111") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(sandbox, "sleep 111")


def test_streamed_binary_output_is_exact(sandbox: Sandbox) -> None:
    """K1 streaming: 1 MiB of random bytes through a streamed exec is byte-exact."""
    sandbox.exec("head -c 1048576 /dev/urandom > /tmp/r")
    want = sandbox.files.read("/tmp/r")
    events = list(sandbox.exec_stream(["cat", "/tmp/r"]))
    assert b"".join(e.data for e in events if e.type == "stdout") == want
    chunks: list[bytes] = []
    r = sandbox.exec(["cat", "/tmp/r"], on_stdout=chunks.append)
    assert b"".join(chunks) == want == r.stdout


# --------------------------------------------------------------------------- spawn


def test_spawned_process_runs_in_the_background_and_reports_its_end(sandbox: Sandbox) -> None:
    """K3/K4 spawn: spawn returns at once; wait reports the exit code; output is readable."""
    t0 = time.monotonic()
    p = sandbox.spawn("echo out; printf 'e\\342' >&2; sleep 1; exit 4")
    assert time.monotonic() - t0 < 1 and p.info.state == "running"
    assert p.id in [q.id for q in sandbox.processes()]
    info = p.wait(timeout_s=10)
    assert (info.state, info.exit_code) == ("exited", 4)
    assert p.read_output("stdout").data == b"out\n"
    assert p.read_output("stderr").data == b"e\xe2"
    chunk = p.read_output("stdout", offset=2)
    assert chunk.data == b"t\n" and chunk.next_offset == 4


def test_spawned_process_can_be_killed_with_its_children(sandbox: Sandbox) -> None:
    """K3 spawn: kill ends the process and what it started (also setsid'd); ps agrees."""
    p = sandbox.spawn("setsid sleep 112 & sleep 112 & sleep 112")
    time.sleep(0.5)
    assert len(_running(sandbox, "sleep 112")) == 3
    info = p.kill()
    assert info.state in ("killed", "signaled")
    assert p.wait(timeout_s=5).state in ("killed", "signaled")
    deadline = time.monotonic() + 2
    while _running(sandbox, "sleep 112") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(sandbox, "sleep 112")


def test_spawned_process_reports_death_by_signal(sandbox: Sandbox) -> None:
    """K4 spawn: a spawned process killed by a signal from inside is `signaled` with its number."""
    p = sandbox.spawn("kill -TERM $$")
    info = p.wait(timeout_s=10)
    assert (info.state, info.signal, info.exit_code) == ("signaled", 15, None)


def test_spawned_process_timeout(sandbox: Sandbox) -> None:
    """K2 spawn: a spawned process past its timeout_s is `timeout` and its tree is gone."""
    p = sandbox.spawn("echo started; setsid sleep 113 & sleep 113", timeout_s=1)
    info = p.wait(timeout_s=10)
    assert info.state == "timeout" and info.exit_code is None
    assert p.read_output().data == b"started\n"
    time.sleep(0.5)
    assert not _running(sandbox, "sleep 113")


def test_spawned_process_stdin(sandbox: Sandbox) -> None:
    """K1/K2 spawn: bytes written to stdin arrive exactly; closing stdin ends a reader."""
    p = sandbox.spawn(["cat"], stdin=b"first\0")
    p.write_stdin(b"second\xe2")
    p.write_stdin("ü")
    p.close_stdin()
    info = p.wait(timeout_s=10)
    assert (info.state, info.exit_code) == ("exited", 0)
    assert p.read_output().data == b"first\0second\xe2" + "ü".encode()
    with pytest.raises((errors.FailedPrecondition, errors.NotFound)):
        p.write_stdin(b"late")
    q = sandbox.spawn(["wc", "-c"], close_stdin=True)
    assert q.wait(timeout_s=10).exit_code == 0
    assert q.read_output().data.strip() == b"0"


def test_follow_output_streams_until_the_end(sandbox: Sandbox) -> None:
    """K2 spawn: follow_output yields output as written and stops once the process ended."""
    p = sandbox.spawn("for i in 1 2 3; do echo $i; sleep 0.5; done")
    got: list[tuple[float, bytes]] = []
    t0 = time.monotonic()
    for chunk in p.follow_output():
        got.append((time.monotonic() - t0, chunk.data))
    assert b"".join(d for _, d in got) == b"1\n2\n3\n"
    assert got[0][0] < got[-1][0] - 0.5
    assert p.wait(timeout_s=5).state == "exited"


def test_a_spawned_process_outlives_the_client(fleet: Fleet, sandbox: Sandbox) -> None:
    """K3 spawn: the process keeps running without its handle and is found again by id."""
    p = sandbox.spawn("sleep 1; echo later")
    again = fleet.client.get(sandbox.id).process(p.id)
    assert again.wait(timeout_s=10).exit_code == 0
    assert again.read_output().data == b"later\n"


def test_spawned_process_output_is_bounded(sandbox: Sandbox) -> None:
    """K5 spawn: unbounded output keeps only the most recent bytes and counts what was dropped."""
    p = sandbox.spawn("yes", max_output_bytes=1 << 20)
    time.sleep(1)
    p.kill()
    p.wait(timeout_s=5)
    chunk = p.read_output()
    assert chunk.dropped > 0 and len(chunk.data) <= 1 << 20
    assert (chunk.offset == chunk.dropped and chunk.data.endswith(b"y\n")) or chunk.data == b""
    assert sandbox.exec("echo fine").stdout == b"fine\n"


def test_destroy_with_running_processes_leaves_nothing(fleet: Fleet) -> None:
    """K9 spawn: destroying a sandbox with spawned processes (one following) leaks nothing."""
    sb = fleet.create()
    p = sb.spawn("while true; do echo tick; sleep 0.2; done")
    sb.spawn("setsid sleep 114")
    stop = threading.Event()

    def follow() -> None:
        try:
            for _ in p.follow_output():
                if stop.is_set():
                    break
        except errors.SandfleetError:
            pass

    thread = threading.Thread(target=follow)
    thread.start()
    time.sleep(0.5)
    sb.destroy()
    stop.set()
    thread.join(10)
    assert not thread.is_alive(), "follow_output hangs after destroy"
    assert fleet.traces() == []


# --------------------------------------------------------------------------- user=


@pytest.mark.parametrize(
    ("user", "ids"),
    [
        ("nobody", "65534 65534"),
        ("65534", "65534 65534"),
        ("nobody:root", "65534 0"),
        (None, "0 0"),
    ],
)
def test_exec_as_another_user(sandbox: Sandbox, user: str | None, ids: str) -> None:
    """K6 user=: the command runs with exactly the uid and gid asked for."""
    r = sandbox.exec('echo "$(id -u) $(id -g)"', user=user)
    assert r.ok and r.stdout == f"{ids}\n".encode(), r


def test_an_unprivileged_user_cannot_regain_root(sandbox: Sandbox) -> None:
    """K10 user=: nobody cannot write root's files, read /root, or become root again."""
    sandbox.exec("chmod 700 /root; echo secret > /root/s")
    r = sandbox.exec("cat /root/s", user="nobody")
    assert r.exit_code != 0 and b"secret" not in r.stdout
    r = sandbox.exec("echo x >> /etc/passwd", user="nobody")
    assert r.exit_code != 0
    r = sandbox.exec("su -c 'id -u' root </dev/null", user="nobody", timeout_s=5)
    assert r.stdout.strip() != b"0"
    assert sandbox.files.read("/etc/passwd").startswith(b"root:x:0:0:")
    assert sandbox.exec("id -u", user="nobody").stdout == b"65534\n"


def test_files_made_as_a_user_belong_to_it(sandbox: Sandbox) -> None:
    """K6 user=: a file written as nobody is owned by 65534; a spawned process runs as nobody."""
    assert sandbox.exec("echo x > /tmp/mine", user="nobody").ok
    assert sandbox.exec(["stat", "-c", "%u", "/tmp/mine"]).stdout == b"65534\n"
    p = sandbox.spawn("id -u", user="nobody")
    assert p.wait(timeout_s=10).exit_code == 0
    assert p.read_output().data == b"65534\n"


@pytest.mark.parametrize("user", ["no-such-user", "nobody:no-such-group", "nobody\n", ""], ids=repr)
def test_an_unknown_user_is_a_clear_error(sandbox: Sandbox, user: str) -> None:
    """K6 user=: a user or group the sandbox does not know is InvalidArgument, not root."""
    with pytest.raises(errors.InvalidArgument):
        sandbox.exec("id -u", user=user)


# --------------------------------------------------------------------------- disk_mb=


def test_writing_past_disk_mb_is_no_space_left(fleet: Fleet) -> None:
    """K5 disk_mb=: writing past the limit fails with ENOSPC inside; freeing space recovers."""
    sb = fleet.create(disk_mb=32)
    r = sb.exec("dd if=/dev/zero of=/tmp/big bs=1M count=64", timeout_s=60)
    assert r.exit_code != 0 and b"No space left on device" in r.stderr, r
    used = int(sb.exec("du -m /tmp/big | cut -f1").stdout)
    assert used <= 32
    assert sb.exec("echo still").stdout == b"still\n"
    with pytest.raises(errors.SandfleetError):
        sb.files.write("/tmp/more", b"\0" * (40 << 20))
    assert sb.exec("rm /tmp/big /tmp/more 2>/dev/null; echo ok > /tmp/small && cat /tmp/small").ok


def test_disk_mb_of_one_sandbox_does_not_limit_another(fleet: Fleet) -> None:
    """K5 disk_mb=: a full sandbox leaves a neighbour's writes unaffected."""
    full, other = fleet.create(disk_mb=32), fleet.create(disk_mb=256)
    full.exec("dd if=/dev/zero of=/tmp/big bs=1M count=64", timeout_s=60)
    r = other.exec("dd if=/dev/zero of=/tmp/big bs=1M count=64 && echo wrote", timeout_s=60)
    assert r.ok and r.stdout.endswith(b"wrote\n"), r


@pytest.mark.parametrize("disk_mb", [0, 1, -5])
def test_an_impossible_disk_mb_is_refused(fleet: Fleet, disk_mb: int) -> None:
    """K5 disk_mb=: a size below the minimum is InvalidArgument naming disk_mb."""
    with pytest.raises(errors.InvalidArgument, match="disk_mb"):
        fleet.create(disk_mb=disk_mb)
