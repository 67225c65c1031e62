"""Conformance: what runs inside — output, timeouts, process lifecycle, exit status, parameters.

CASES K1 (output fidelity), K2 (timeouts and hangs), K3 (process lifecycle),
K4 (exit status) and K6 (parameters arrive exactly), for every built kind.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from sandfleet import errors
from sandfleet.sdk import Client, Sandbox
from sandfleet.wire.models import ExecResult
from tests.conformance.conftest import Fleet

pytestmark = pytest.mark.root

# --------------------------------------------------------------------------- K1


@pytest.mark.parametrize(
    ("script", "stdout", "stderr"),
    [
        (r"printf '\342'", b"\xe2", b""),
        (r"printf 'a\0b\0'", b"a\0b\0", b""),
        (r"printf 'ok\377\376\300\200' >&2", b"", b"ok\xff\xfe\xc0\x80"),
        (r"printf 'one\r\ntwo\r\n'", b"one\r\ntwo\r\n", b""),
        (r"printf 'no newline'", b"no newline", b""),
        (r"printf '\0'; printf '\342\202' >&2", b"\0", b"\xe2\x82"),
        (r"printf '\n\n\n'", b"\n\n\n", b""),
    ],
    ids=["e2-alone", "nuls", "bad-utf8-stderr", "crlf", "no-newline", "split-utf8", "newlines"],
)
def test_output_is_bytes_exactly(
    sandbox: Sandbox, script: str, stdout: bytes, stderr: bytes
) -> None:
    """K1: output arrives byte for byte; the text views decode with replacement, never raise."""
    r = sandbox.exec(script)
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("exited", 0, stdout, stderr)
    assert r.stdout_text == stdout.decode("utf-8", errors="replace")
    assert r.stderr_text == stderr.decode("utf-8", errors="replace")


def test_a_mebibyte_of_random_bytes_through_stdout_and_stdin(sandbox: Sandbox) -> None:
    """K1: 1 MiB of random bytes through stdout (from a file and from stdin) is byte-exact."""
    blob = os.urandom(1 << 20)
    sandbox.files.write("/tmp/blob", blob)
    r = sandbox.exec(["cat", "/tmp/blob"])
    assert r.ok and r.stdout == blob and r.stdout_dropped == 0
    r = sandbox.exec(["cat"], stdin=blob)
    assert r.ok and r.stdout == blob
    r = sandbox.exec("cat >&2", stdin=blob)
    assert r.ok and r.stderr == blob and r.stdout == b""


def test_stdout_and_stderr_stay_apart(sandbox: Sandbox) -> None:
    """K1: interleaved writes to the two streams are not mixed up."""
    r = sandbox.exec("for i in 1 2 3; do echo out$i; echo err$i >&2; done")
    assert r.stdout == b"out1\nout2\nout3\n" and r.stderr == b"err1\nerr2\nerr3\n"


# --------------------------------------------------------------------------- K2


def _running(sandbox: Sandbox, needle: str) -> list[str]:
    """Command lines of processes in the sandbox that contain ``needle``."""
    ps = sandbox.exec(["ps", "-o", "pid,args"])
    assert ps.ok, ps
    return [line for line in ps.stdout_text.splitlines() if needle in line]


def _gone_within(sandbox: Sandbox, needle: str, seconds: float) -> list[str]:
    """Wait up to ``seconds`` for every process matching ``needle`` to end; return survivors."""
    deadline = time.monotonic() + seconds
    while True:
        left = _running(sandbox, needle)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("script", "needle"),
    [
        ("sleep 101", "sleep 101"),
        ("sleep 102 & sleep 102 & wait", "sleep 102"),
        ("trap '' TERM; sleep 103 & wait; sleep 103", "sleep 103"),
        ("setsid sleep 104 & sleep 10", "sleep 104"),
        ("(sleep 105 &); sleep 10", "sleep 105"),
        ("nohup sh -c 'trap \"\" TERM HUP; sleep 106' >/dev/null 2>&1 & sleep 10", "sleep 106"),
    ],
    ids=["plain", "children", "ignores-term", "setsid", "double-fork", "nohup-detached"],
)
def test_timeout_is_reported_and_kills_everything(
    sandbox: Sandbox, script: str, needle: str
) -> None:
    """K2: a command past its timeout returns in about 1 s as `timeout`; all it started dies."""
    t0 = time.monotonic()
    r = sandbox.exec(script, timeout_s=1)
    elapsed = time.monotonic() - t0
    assert r.status == "timeout" and r.exit_code is None and r.signal is None, r
    assert 0.9 <= elapsed < 2.5, elapsed
    assert not _gone_within(sandbox, needle, 1.0), "survived the timeout"
    assert sandbox.exec("echo next").stdout == b"next\n"


@pytest.mark.parametrize(
    ("script", "stdout", "stderr"),
    [
        ("echo early; sleep 10", b"early\n", b""),
        ("echo to-err >&2; sleep 10", b"", b"to-err\n"),
        ("printf partial; printf half >&2; sleep 10", b"partial", b"half"),
        ("head -c 100000 /dev/zero; sleep 10", b"\0" * 100000, b""),
    ],
    ids=["stdout-line", "stderr-line", "partial-lines", "100k"],
)
def test_output_before_a_timeout_is_kept(
    sandbox: Sandbox, script: str, stdout: bytes, stderr: bytes
) -> None:
    """K2: what the command printed before its timeout is in the result."""
    r = sandbox.exec(script, timeout_s=1)
    assert r.status == "timeout"
    assert (r.stdout, r.stderr) == (stdout, stderr)


@pytest.mark.parametrize(
    ("cmd", "code", "out"),
    [
        (["cat"], 0, b""),
        (["grep", "x"], 1, b""),
        (["wc", "-c"], 0, b"0\n"),
        ("read line; echo $?", 0, b"1\n"),
        (["sh"], 0, b""),
    ],
    ids=["cat", "grep", "wc", "read", "sh"],
)
def test_stdin_is_empty_unless_given(
    sandbox: Sandbox, cmd: str | list[str], code: int, out: bytes
) -> None:
    """K2: readers of stdin see end of file at once when the caller gives no stdin."""
    t0 = time.monotonic()
    r = sandbox.exec(cmd, timeout_s=5)
    assert (r.status, r.exit_code, r.stdout.strip(b" ")) == ("exited", code, out)
    assert time.monotonic() - t0 < 2


@pytest.mark.parametrize("cmd", [["true"], ["head", "-c", "1"], "exit 0"], ids=repr)
def test_stdin_nobody_reads_does_not_block(sandbox: Sandbox, cmd: str | list[str]) -> None:
    """K2: 10 MiB of stdin given to a command that does not read it all: the call ends at once."""
    t0 = time.monotonic()
    r = sandbox.exec(cmd, stdin=b"x" * (10 << 20), timeout_s=20)
    assert r.ok and r.stdout in (b"", b"x")
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), float("inf")], ids=repr)
def test_an_impossible_timeout_is_refused(sandbox: Sandbox, timeout_s: float) -> None:
    """K2: a timeout that cannot bound the command is InvalidArgument, before anything runs."""
    with pytest.raises(errors.InvalidArgument, match="timeout_s"):
        sandbox.exec("touch /tmp/ran", timeout_s=timeout_s)
    with pytest.raises(errors.NotFound):
        sandbox.files.stat("/tmp/ran")


def test_a_hung_command_does_not_block_other_callers(fleet: Fleet, sandbox: Sandbox) -> None:
    """K2: while `sleep infinity` hangs, a second client reads, runs, lists and checks health."""
    sandbox.files.write("/tmp/note", b"note")
    hung: dict[str, ExecResult | float] = {}

    def hang() -> None:
        t0 = time.monotonic()
        hung["result"] = sandbox.exec("sleep infinity", timeout_s=4)
        hung["elapsed"] = time.monotonic() - t0

    thread = threading.Thread(target=hang)
    thread.start()
    time.sleep(0.5)
    with Client(fleet.url) as other:
        same = other.get(sandbox.id)
        for _ in range(3):
            t0 = time.monotonic()
            assert same.files.read("/tmp/note") == b"note"
            assert same.exec("echo ok").stdout == b"ok\n"
            assert "note" in {e.name for e in same.files.list("/tmp")}
            assert same.refresh().state == "running"
            assert time.monotonic() - t0 < 1.5
        assert _running(same, "sleep infinity")
    thread.join(10)
    assert not thread.is_alive()
    result = hung["result"]
    assert isinstance(result, ExecResult) and result.status == "timeout"
    assert 3.9 <= float(hung["elapsed"]) < 6
    assert not _gone_within(sandbox, "sleep infinity", 1.0)
    assert sandbox.exec("echo usable").stdout == b"usable\n"


def test_background_jobs_do_not_hold_the_call(sandbox: Sandbox) -> None:
    """K2: a command that leaves a job behind (even holding stdout) returns when it exits."""
    t0 = time.monotonic()
    r = sandbox.exec("sleep 107 & echo started")
    assert r.ok and r.stdout == b"started\n"
    assert time.monotonic() - t0 < 2
    assert _running(sandbox, "sleep 107")
    assert sandbox.exec(["killall", "sleep"]).ok
    assert not _gone_within(sandbox, "sleep 107", 1.0)


# --------------------------------------------------------------------------- K3


def _zombies(sandbox: Sandbox) -> list[str]:
    ps = sandbox.exec(["ps", "-o", "stat,pid,ppid,args"])
    assert ps.ok, ps
    return [line for line in ps.stdout_text.splitlines()[1:] if line.split()[0].startswith("Z")]


def test_orphans_of_200_commands_are_reaped(sandbox: Sandbox) -> None:
    """K3: 200 commands each leave a 0.1 s sleep; 2 s later no zombie, and new processes start."""
    for _ in range(200):
        r = sandbox.exec("sleep 0.1 & exit 0")
        assert r.ok, r
    time.sleep(2)
    assert not _zombies(sandbox)
    assert not _running(sandbox, "sleep 0.1")
    assert sandbox.exec(["echo", "fresh"]).stdout == b"fresh\n"


@pytest.mark.parametrize(
    "script",
    [
        "for i in $(seq 200); do sleep 0.1 & done; exit 0",
        "(sleep 0.2 &); (sh -c 'sleep 0.2 &' &); exit 0",
        "setsid sh -c 'sleep 0.2 & exit 0' & exit 0",
        "sh -c 'sh -c \"sleep 0.2 &\" &' ; exit 0",
    ],
    ids=["200-in-one", "double-fork", "setsid-daemon", "nested"],
)
def test_daemons_and_orphans_are_reaped(sandbox: Sandbox, script: str) -> None:
    """K3: double-forked and detached daemons become orphans that are reaped when they end."""
    assert sandbox.exec(script).ok
    time.sleep(2)
    assert not _zombies(sandbox)
    assert not _running(sandbox, "sleep 0.")
    assert sandbox.exec("echo fresh").stdout == b"fresh\n"


# --------------------------------------------------------------------------- K4


@pytest.mark.parametrize(
    ("cmd", "code"),
    [
        ("exit 3", 3),
        (["false"], 1),
        ("false", 1),
        (["true"], 0),
        ("exit 255", 255),
        ("exit 137", 137),
        (["sh", "-c", "exit 42"], 42),
    ],
)
def test_exit_codes_are_reported_exactly(sandbox: Sandbox, cmd: str | list[str], code: int) -> None:
    """K4: an exit code is reported as status `exited` with that exact code (137 is no signal)."""
    r = sandbox.exec(cmd)
    assert (r.status, r.exit_code, r.signal) == ("exited", code, None)


@pytest.mark.parametrize(
    "cmd",
    [["no-such-command-x"], "no-such-command-x", "no-such-command-x --flag; exit $?"],
    ids=["argv", "shell", "shell-propagated"],
)
def test_missing_command_is_127_with_a_message(sandbox: Sandbox, cmd: str | list[str]) -> None:
    """K4: a command that does not exist exits 127 with a message naming it on stderr."""
    r = sandbox.exec(cmd)
    assert (r.status, r.exit_code) == ("exited", 127)
    assert b"no-such-command-x" in r.stderr


@pytest.mark.parametrize("cmd", [["/tmp/not-exec"], "/tmp/not-exec"], ids=["argv", "shell"])
def test_a_file_that_cannot_be_executed_is_126(sandbox: Sandbox, cmd: str | list[str]) -> None:
    """K4: a file without execute permission exits 126 with a message, not 127 or an error."""
    sandbox.files.write("/tmp/not-exec", b"#!/bin/sh\necho hi\n", mode=0o644)
    r = sandbox.exec(cmd)
    assert (r.status, r.exit_code) == ("exited", 126) and r.stderr


@pytest.mark.parametrize(
    ("cmd", "sig"),
    [
        ("kill -9 $$", 9),
        ("kill -15 $$", 15),
        ("kill -SEGV $$", 11),
        ("kill -INT $$", 2),
        (["sh", "-c", "kill -KILL $$"], 9),
        ("exec sleep 30", 9),
    ],
    ids=["kill-9", "kill-15", "segv", "int", "argv-kill", "killed-from-outside"],
)
def test_death_by_signal_is_reported_as_such(
    sandbox: Sandbox, cmd: str | list[str], sig: int
) -> None:
    """K4: death by a signal is status `signaled` with the signal number and no exit code."""
    if cmd == "exec sleep 30":
        killer = threading.Timer(0.5, lambda: sandbox.exec(["killall", "-KILL", "sleep"]))
        killer.start()
        r = sandbox.exec(cmd, timeout_s=20)
        killer.join()
    else:
        r = sandbox.exec(cmd)
    assert (r.status, r.exit_code, r.signal) == ("signaled", None, sig), r
    assert not r.ok


# --------------------------------------------------------------------------- K6

VALUES = ["hello world", "a\nb", "$HOME", "it's", "", "ü", " lead and trail ", "a=b;c|d&`e`"]
PRINT_V = ["awk", 'BEGIN { printf "%s", ENVIRON["V"] }']


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_env_values_arrive_byte_identical(fleet: Fleet, value: str) -> None:
    """K6: env values print back byte-identical, by argv and by shell, per call and per sandbox."""
    want = value.encode()
    sb = fleet.create(env={"V": value})
    assert sb.exec(PRINT_V).stdout == want
    assert sb.exec('printf %s "$V"').stdout == want
    other = "x" + value
    assert sb.exec(PRINT_V, env={"V": other}).stdout == other.encode()
    assert sb.exec(["sh", "-c", 'printf %s "$V"'], env={"V": value}).stdout == want
    present = sb.exec("env | grep -c '^V='")
    assert present.stdout == b"1\n"


def test_argv_arrives_without_a_shell(sandbox: Sandbox) -> None:
    """K6: argv elements reach the program untouched: no splitting, expansion or quoting."""
    args = [*VALUES, "*", "~"]
    r = sandbox.exec(["printf", "%s|", *args])
    assert r.stdout == "".join(a + "|" for a in args).encode()


@pytest.mark.parametrize("bad", [{"V": "a\0b"}, {"A=B": "x"}, {"": "x"}], ids=repr)
def test_env_that_cannot_be_passed_is_refused(sandbox: Sandbox, bad: dict[str, str]) -> None:
    """K6: an env a process cannot receive is a clear InvalidArgument, not a mangled value."""
    with pytest.raises(errors.InvalidArgument):
        sandbox.exec("true", env=bad)


@pytest.mark.parametrize("cwd", ["/tmp", "/work dir", "/tmp/dír ü", "/"], ids=repr)
def test_cwd_is_used_exactly(sandbox: Sandbox, cwd: str) -> None:
    """K6: `pwd` prints the cwd given, also with spaces and non-ASCII."""
    sandbox.files.mkdir(cwd)
    assert sandbox.exec("pwd", cwd=cwd).stdout == cwd.encode() + b"\n"
    assert sandbox.exec(["pwd"], cwd=cwd).stdout == cwd.encode() + b"\n"


@pytest.mark.parametrize("cwd", ["/no/such/dir", "/etc/passwd", "/tmp/gone"], ids=repr)
def test_unusable_cwd_is_a_clear_error(sandbox: Sandbox, cwd: str) -> None:
    """K6: a missing or non-directory cwd is InvalidArgument naming it, never a silent fallback."""
    sandbox.exec("mkdir /tmp/gone && rmdir /tmp/gone")
    with pytest.raises(errors.InvalidArgument, match=cwd):
        sandbox.exec("pwd", cwd=cwd)
    with pytest.raises(errors.InvalidArgument, match=cwd):
        sandbox.exec(["pwd"], cwd=cwd)


def test_killing_every_process_in_sight_still_gets_a_result(fleet: Fleet, sandbox: Sandbox) -> None:
    """K2/K4: `kill -9 -1` (a common agent clean-up) ends with a result; other calls survive it."""
    sandbox.exec("sleep 108 & sleep 108 & exit 0")
    hung: dict[str, object] = {}

    def other_call() -> None:
        try:
            hung["result"] = sandbox.exec("sleep 3; echo survived", timeout_s=10)
        except errors.SandfleetError as exc:
            hung["result"] = exc

    thread = threading.Thread(target=other_call)
    thread.start()
    time.sleep(0.5)
    r = sandbox.exec("kill -9 -1; sleep 1; echo after", timeout_s=10)
    assert r.status in ("exited", "signaled"), r
    thread.join(15)
    assert not _running(sandbox, "sleep 108")
    assert sandbox.exec("echo usable").stdout == b"usable\n"
    other = hung["result"]
    # the concurrent command may die of the signal too, but its call must end in a result
    assert isinstance(other, ExecResult), other
