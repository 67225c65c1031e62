"""Streaming exec and background processes, end to end through a real deployment.

SDK → control plane (proxying streams) → node agent → runc container → in-sandbox agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable

import pytest

from sandfleet import errors
from sandfleet.cli.local import LocalDeployment
from sandfleet.sdk import AsyncClient, Client, Sandbox
from sandfleet.wire.models import ExecEvent, ExecResult
from tests.conftest import BUSYBOX_IMAGE

pytestmark = pytest.mark.root


def _sleepers(sb: Sandbox, seconds: str) -> list[str]:
    """Processes in the sandbox that are ``sleep <seconds>`` (a regex), as ``ps`` lines."""
    out = sb.exec(["ps", "-o", "pid,args"]).stdout_text.splitlines()
    return [line for line in out if re.fullmatch(rf"\s*\d+\s+sleep {seconds}", line)]


def _eventually(check: Callable[[], bool], within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


# --------------------------------------------------------------------------- streaming exec


def test_callbacks_get_output_before_the_command_ends(deployment: LocalDeployment) -> None:
    with Client(deployment.url) as client, client.create(image=BUSYBOX_IMAGE) as sb:
        seen: list[tuple[float, bytes]] = []
        errs: list[bytes] = []
        t0 = time.monotonic()
        r = sb.exec(
            "echo a; sleep 1; echo b; echo e >&2",
            on_stdout=lambda b: seen.append((time.monotonic() - t0, b)),
            on_stderr=errs.append,
        )
        done = time.monotonic() - t0
        assert seen[0][1] == b"a\n"
        assert seen[0][0] < 0.5, f"first line came after {seen[0][0]:.3f} s"
        assert done >= 1.0 and done - seen[0][0] > 0.8
        assert (r.status, r.exit_code, r.stdout, r.stderr) == ("exited", 0, b"a\nb\n", b"e\n")
        assert b"".join(b for _, b in seen) == r.stdout and b"".join(errs) == r.stderr


def test_async_callbacks_may_be_coroutines(deployment: LocalDeployment) -> None:
    async def main() -> None:
        async with (
            AsyncClient(deployment.url) as client,
            await client.create(image=BUSYBOX_IMAGE) as sb,
        ):
            got: list[tuple[float, bytes]] = []
            t0 = time.monotonic()

            async def on_out(data: bytes) -> None:
                await asyncio.sleep(0)
                got.append((time.monotonic() - t0, data))

            r = await sb.exec("echo a; sleep 1; echo b", on_stdout=on_out)
            assert got[0] == (got[0][0], b"a\n") and got[0][0] < 0.5
            assert r.stdout == b"a\nb\n" and r.ok

    asyncio.run(main())


def test_stream_bytes_are_exact_and_match_plain_exec(deployment: LocalDeployment) -> None:
    with Client(deployment.url) as client, client.create(image=BUSYBOX_IMAGE) as sb:
        sb.exec("head -c 3000000 /dev/urandom > /tmp/blob")
        cmd = "printf 'x\\342\\0y\\0'; cat /tmp/blob; printf '\\0\\342' >&2; cat /tmp/blob >&2"
        plain = sb.exec(cmd)
        out, err = bytearray(), bytearray()
        streamed = sb.exec(cmd, on_stdout=out.extend, on_stderr=err.extend)
        assert plain.stdout[:5] == b"x\xe2\0y\0" and len(plain.stdout) == 3_000_005
        assert plain.stderr[:2] == b"\0\xe2"
        assert bytes(out) == streamed.stdout == plain.stdout
        assert bytes(err) == streamed.stderr == plain.stderr

        # over the cap: the chunks are the head and the tail, as plain exec keeps them
        capped = sb.exec("cat /tmp/blob", max_output_bytes=1000)
        events = list(sb.exec_stream("cat /tmp/blob", max_output_bytes=1000))
        chunks = b"".join(e.data for e in events if e.type == "stdout")
        result = events[-1].result
        assert result is not None and chunks == capped.stdout and len(chunks) == 1000
        assert result.stdout_dropped == capped.stdout_dropped == 3_000_000 - 1000


def test_exec_stream_sync(deployment: LocalDeployment) -> None:
    with Client(deployment.url) as client, client.create(image=BUSYBOX_IMAGE) as sb:
        events = list(sb.exec_stream("echo out; echo err >&2; exit 4", env={"X": "1"}))
        assert all(isinstance(e, ExecEvent) for e in events)
        assert events[-1].type == "result" and [e.type for e in events[:-1]] != []
        result = events[-1].result
        assert isinstance(result, ExecResult)
        assert (result.status, result.exit_code, result.stdout, result.stderr) == (
            "exited",
            4,
            b"",
            b"",
        )
        assert b"".join(e.data for e in events if e.type == "stdout") == b"out\n"
        assert b"".join(e.data for e in events if e.type == "stderr") == b"err\n"
        timed = list(sb.exec_stream("echo early; sleep 10", timeout_s=1))
        assert timed[0].data == b"early\n" and timed[-1].result is not None
        assert timed[-1].result.status == "timeout"


def test_exec_stream_async(deployment: LocalDeployment) -> None:
    async def main() -> None:
        async with (
            AsyncClient(deployment.url) as client,
            await client.create(image=BUSYBOX_IMAGE) as sb,
        ):
            types, data = [], bytearray()
            async for event in sb.exec_stream(["sh", "-c", "cat; echo end"], stdin="in"):
                types.append(event.type)
                data += event.data
            assert types[-1] == "result" and bytes(data) == b"inend\n"

    asyncio.run(main())


def test_errors_before_streaming_are_raised(deployment: LocalDeployment) -> None:
    with Client(deployment.url) as client, client.create(image=BUSYBOX_IMAGE) as sb:
        with pytest.raises(errors.InvalidArgument, match="cwd"):
            list(sb.exec_stream("true", cwd="/no/such/dir"))
        with pytest.raises(errors.InvalidArgument, match="cwd"):
            sb.exec("true", cwd="/no/such/dir", on_stdout=print)
        with pytest.raises(errors.InvalidArgument):
            sb.exec("true", user="no-such-user", on_stdout=print)
        with pytest.raises(errors.InvalidArgument):
            list(sb.exec_stream("true", timeout_s=0))
        ghost = client.get(sb.id)
        ghost._info = ghost._info.model_copy(update={"id": sb.id[:-1] + "x"})
        with pytest.raises(errors.NotFound):
            list(ghost.exec_stream("true"))


def test_closing_a_stream_kills_the_command(deployment: LocalDeployment) -> None:
    with Client(deployment.url) as client, client.create(image=BUSYBOX_IMAGE) as sb:
        # sync: close the iterator after the first line
        stream = sb.exec_stream("echo started; sleep 101")
        assert next(stream).data == b"started\n"
        assert _sleepers(sb, "101")
        stream.close()  # type: ignore[attr-defined]
        assert _eventually(lambda: not _sleepers(sb, "101")), _sleepers(sb, "101")

        # a callback that raises ends the call, and the command with it
        def boom(_: bytes) -> None:
            raise RuntimeError("enough")

        with pytest.raises(RuntimeError, match="enough"):
            sb.exec("echo go; sleep 102", on_stdout=boom)
        assert _eventually(lambda: not _sleepers(sb, "102")), _sleepers(sb, "102")

        # async: break out of the loop and close; and cancel a task mid-stream
        async def main() -> None:
            async with AsyncClient(deployment.url) as aclient:
                asb = await aclient.get(sb.id)
                async with contextlib.aclosing(asb.exec_stream("echo x; sleep 103")) as events:
                    async for _ in events:
                        break
                started = asyncio.Event()

                async def consume() -> None:
                    async for _ in asb.exec_stream("echo y; sleep 104"):
                        started.set()

                task = asyncio.ensure_future(consume())
                await asyncio.wait_for(started.wait(), 10)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

                # cancelled before the first byte: the answer has not even begun
                async def silent() -> None:
                    async for _ in asb.exec_stream("sleep 105"):
                        pass

                task = asyncio.ensure_future(silent())
                await asyncio.sleep(0.5)
                assert _sleepers(sb, "105")
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

        asyncio.run(main())
        assert _eventually(lambda: not _sleepers(sb, "10[345]")), _sleepers(sb, "10[345]")


# --------------------------------------------------------------------------- processes


def test_spawn_and_reattach_from_a_new_client(deployment: LocalDeployment) -> None:
    with Client(deployment.url) as client:
        sb = client.create(image=BUSYBOX_IMAGE, env={"A": "sandbox"})
        try:
            proc = sb.spawn(
                "echo $A-$B; echo oops >&2; read line; echo got:$line; sleep 0.3; echo done",
                env={"B": "request"},
            )
            assert proc.id and proc.info.state == "running" and proc.info.stdin_open
            pid = proc.id
            sid = sb.id
            assert _eventually(lambda: proc.read_output().data.startswith(b"sandbox-request\n"))
        except BaseException:
            sb.destroy()
            raise
    # the first client is closed: a new one finds the process by id
    with Client(deployment.url) as client:
        sb2 = client.get(sid)
        try:
            again = sb2.process(pid)
            assert again.id == pid and again.info.state == "running"
            first = again.read_output()
            assert first.data == b"sandbox-request\n" and first.offset == 0
            assert again.read_output("stderr").data == b"oops\n"
            assert again.read_output(offset=8).data == b"request\n"
            again.write_stdin("hello\n")
            followed = list(again.follow_output(offset=first.next_offset))
            assert b"".join(c.data for c in followed) == b"got:hello\ndone\n"
            assert followed[0].offset == first.next_offset
            info = again.wait()
            assert (info.state, info.exit_code, info.stdout_bytes) == ("exited", 0, 31)
            assert again.info is info and again.refresh().state == "exited"
            assert [p.id for p in sb2.processes()] == [pid]
            again.remove()
            assert sb2.processes() == []
            with pytest.raises(errors.NotFound):
                sb2.process(pid)
            with pytest.raises(errors.NotFound):
                again.read_output()
        finally:
            sb2.destroy()


def test_follow_wait_and_list_async(deployment: LocalDeployment) -> None:
    async def main() -> None:
        async with (
            AsyncClient(deployment.url) as client,
            await client.create(image=BUSYBOX_IMAGE) as sb,
        ):
            proc = await sb.spawn("for i in 1 2 3; do echo $i; sleep 0.2; done")
            t0 = time.monotonic()
            arrivals = []
            async for chunk in proc.follow_output():
                arrivals.append((time.monotonic() - t0, chunk.data))
            assert b"".join(d for _, d in arrivals) == b"1\n2\n3\n"
            assert arrivals[0][0] < 0.3 and arrivals[-1][0] > 0.3  # live, not at the end
            waited = await proc.wait(timeout_s=5)
            assert waited.state == "exited" and waited.ended_at is not None

            slow = await sb.spawn(["sleep", "30"])
            t0 = time.monotonic()
            assert (await slow.wait(timeout_s=0.3)).state == "running"
            assert 0.25 < time.monotonic() - t0 < 3
            ids = {p.id for p in await sb.processes()}
            assert ids == {proc.id, slow.id}
            with pytest.raises(errors.FailedPrecondition):
                await slow.remove()  # still running
            killed = await slow.kill(15)
            assert killed.state == "killed" or (await slow.wait(5)).state == "killed"
            await slow.remove()
            await proc.remove()
            assert await sb.processes() == []

    asyncio.run(main())


def test_wait_without_timeout_outlasts_the_client_timeout(deployment: LocalDeployment) -> None:
    with Client(deployment.url, timeout_s=0.5) as client, client.create(image=BUSYBOX_IMAGE) as sb:
        proc = sb.spawn("sleep 1.5; exit 7")
        t0 = time.monotonic()
        info = proc.wait()
        assert (info.state, info.exit_code) == ("exited", 7) and time.monotonic() - t0 > 1.2
        chunks = list(sb.spawn("sleep 1.2; echo late").follow_output())
        assert b"".join(c.data for c in chunks) == b"late\n"


def test_kill_takes_the_whole_tree(deployment: LocalDeployment) -> None:
    with Client(deployment.url) as client, client.create(image=BUSYBOX_IMAGE) as sb:
        proc = sb.spawn("sh -c 'sleep 100 & sleep 100'")
        assert _eventually(lambda: len(_sleepers(sb, "100")) == 2), _sleepers(sb, "100")
        info = proc.kill()
        assert info.state == "killed" and info.signal == 9
        assert not _sleepers(sb, "100")


def test_stdin_write_and_close(deployment: LocalDeployment) -> None:
    with Client(deployment.url) as client, client.create(image=BUSYBOX_IMAGE) as sb:
        cat = sb.spawn("cat", stdin=b"first\n")
        cat.write_stdin(b"\x00\xe2 second\n")
        cat.write_stdin("third ü\n")
        assert cat.refresh().state == "running"
        cat.close_stdin()
        info = cat.wait(timeout_s=10)
        assert info.state == "exited" and not info.stdin_open
        out = cat.read_output()
        assert out.data == b"first\n\x00\xe2 second\nthird \xc3\xbc\n" and out.eof
        with pytest.raises(errors.FailedPrecondition):
            cat.write_stdin("late")
        closed = sb.spawn("cat", stdin="all at once", close_stdin=True)
        assert closed.wait(10).state == "exited"
        assert closed.read_output().data == b"all at once"


def test_bad_process_arguments(deployment: LocalDeployment) -> None:
    with Client(deployment.url) as client, client.create(image=BUSYBOX_IMAGE) as sb:
        with pytest.raises(errors.InvalidArgument, match="cwd"):
            sb.spawn("true", cwd="/no/such/dir")
        with pytest.raises(errors.NotFound):
            sb.process("p999")
        proc = sb.spawn("true")
        with pytest.raises(errors.InvalidArgument):
            proc.read_output("stdlog")
        with pytest.raises(errors.InvalidArgument):
            proc.kill(0)
        with pytest.raises(errors.InvalidArgument):
            proc.wait(-1)
        proc.wait()


# --------------------------------------------------------------------------- users


def test_user_nobody(deployment: LocalDeployment) -> None:
    with Client(deployment.url) as client, client.create(image=BUSYBOX_IMAGE) as sb:
        assert sb.exec("id -u", user="nobody").stdout == b"65534\n"
        streamed = bytearray()
        assert sb.exec("id -u", user="65534", on_stdout=streamed.extend).ok
        assert bytes(streamed) == b"65534\n"
        proc = sb.spawn("id -u; id -g", user="nobody")
        assert proc.wait(10).state == "exited"
        assert proc.read_output().data == b"65534\n65534\n"
        assert sb.exec("id -u").stdout == b"0\n"
        assert client.run("id -u", image=BUSYBOX_IMAGE, user="nobody").stdout == b"65534\n"
