"""Conformance of kind ``fncall``: the suite's applicable cases for stateless calls.

CASES K1 (output bytes), K2 (timeouts and hangs), K3 (processes of a call),
K4 (exit status), K6/K7 (parameters and files), K5 (limits) and K10 (no way
out), for calls run by ``client.run`` in the warm pools of the fncall image.
The expectations are those of the container suite, put in terms of a call:
a program in python, bash, C or C++ instead of a command in a sandbox.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandfleet import errors
from sandfleet.cli.local import LocalDeployment
from sandfleet.sdk import AsyncClient, Client
from sandfleet.wire.models import RunResult
from tests.conftest import FnClient

pytestmark = pytest.mark.root

#: Default cap of captured stdout and stderr each (RunRequest.max_output_bytes).
OUTPUT_CAP = 1 << 20


@pytest.fixture(scope="module")
def client(fncall_dep: LocalDeployment) -> Iterator[Client]:
    with FnClient(fncall_dep.url, timeout_s=60) as c:
        yield c


def host_processes(marker: str) -> list[str]:
    """Command lines of host processes whose command line contains ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            shown = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry.name}: {shown}")
    return found


def gone_on_host(marker: str, seconds: float = 1.0) -> list[str]:
    """Wait up to ``seconds`` for every host process matching ``marker`` to end; survivors."""
    deadline = time.monotonic() + seconds
    while True:
        left = host_processes(marker)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def sleep_marker() -> str:
    """A `sleep` duration no other process on the host uses, e.g. ``9123.456789``."""
    return f"9{secrets.randbelow(1000):03d}.{secrets.randbelow(10**6):06d}"


#: A python call printing the command lines of the processes it can see that contain argv[1].
PY_FIND = """
import os, sys
for p in os.listdir('/proc'):
    if p.isdigit():
        try:
            cmd = open('/proc/%s/cmdline' % p, 'rb').read().replace(b'\\0', b' ')
        except OSError:
            continue
        if sys.argv[1].encode() in cmd and int(p) != os.getpid():
            print(p, cmd.decode())
"""

BASH_FIND = (
    'for p in /proc/[0-9]*; do c=$(tr "\\0" " " < $p/cmdline 2>/dev/null); '
    'case "$c" in *"$1"*) [ "${p#/proc/}" != $$ ] && echo "$p $c";; esac; done; true'
)


# --------------------------------------------------------------------------- K1


PY_WRITE = "import sys\nsys.stdout.buffer.write({out!r})\nsys.stderr.buffer.write({err!r})\n"
BYTES_CASES = [
    (b"\xe2", b""),
    (b"a\0b\0", b""),
    (b"", b"ok\xff\xfe\xc0\x80"),
    (b"one\r\ntwo\r\n", b""),
    (b"no newline", b""),
    (b"\0", b"\xe2\x82"),
    (b"\n\n\n", b""),
]
BYTES_IDS = ["e2-alone", "nuls", "bad-utf8-stderr", "crlf", "no-newline", "split-utf8", "newlines"]


def _printf(data: bytes) -> str:
    return "".join(f"\\{b:03o}" for b in data)


@pytest.mark.parametrize(("stdout", "stderr"), BYTES_CASES, ids=BYTES_IDS)
def test_python_output_is_bytes_exactly(client: Client, stdout: bytes, stderr: bytes) -> None:
    """K1: what a python call writes arrives byte for byte; text views never raise."""
    r = client.run(PY_WRITE.format(out=stdout, err=stderr))
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("exited", 0, stdout, stderr), r
    assert r.stdout_text == stdout.decode("utf-8", errors="replace")
    assert r.stderr_text == stderr.decode("utf-8", errors="replace")


@pytest.mark.parametrize(("stdout", "stderr"), BYTES_CASES, ids=BYTES_IDS)
def test_bash_output_is_bytes_exactly(client: Client, stdout: bytes, stderr: bytes) -> None:
    """K1: what a bash call prints arrives byte for byte (the single 0xE2, NULs...)."""
    r = client.run(f"printf '{_printf(stdout)}'; printf '{_printf(stderr)}' >&2", language="bash")
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("exited", 0, stdout, stderr), r


def test_c_output_is_bytes_exactly(client: Client) -> None:
    """K1: a C program's fwrite of 0xE2 and NULs arrives exactly, stdout and stderr apart."""
    code = (
        "#include <stdio.h>\n"
        'int main(void) { fwrite("a\\0b\\0\\342", 1, 5, stdout);'
        ' fwrite("\\342", 1, 1, stderr); return 0; }\n'
    )
    r = client.run(code, language="c")
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("exited", 0, b"a\0b\0\xe2", b"\xe2"), r


def test_python_text_output_is_utf8_and_flushed_at_exit(client: Client) -> None:
    """K1: print() of non-ASCII is UTF-8; unflushed output and atexit output arrive, as with -c."""
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: sys.stdout.write('|bye'))\n"
        "print('ü€', end='')\n"
        "sys.stderr.write('é')\n"
    )
    r = client.run(code)
    assert (r.status, r.exit_code) == ("exited", 0), r
    assert r.stdout == "ü€|bye".encode() and r.stderr == "é".encode()


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_output_past_the_cap_keeps_head_and_tail(client: Client, stream: str) -> None:
    """K5/K1: past 1 MiB (the default cap) the middle is dropped, counted in *_dropped."""
    total = 3_000_000
    code = (
        f"import sys\ns = sys.{stream}.buffer\n"
        f"s.write(b'START\\n')\ns.write(b'y\\n' * {total // 2})\ns.write(b'END\\n')\n"
    )
    r = client.run(code)
    assert (r.status, r.exit_code) == ("exited", 0), r
    out, dropped = (
        (r.stdout, r.stdout_dropped) if stream == "stdout" else (r.stderr, r.stderr_dropped)
    )
    other, other_dropped = (
        (r.stderr, r.stderr_dropped) if stream == "stdout" else (r.stdout, r.stdout_dropped)
    )
    assert out.startswith(b"START\ny\n") and out.endswith(b"y\nEND\n")
    assert 0 < len(out) <= OUTPUT_CAP and dropped > 0
    assert len(out) + dropped == len(b"START\n") + total + len(b"END\n")
    assert (other, other_dropped) == (b"", 0)


@pytest.mark.parametrize("cap", [0, 1000])
def test_max_output_bytes_is_the_cap(client: Client, cap: int) -> None:
    """K1: max_output_bytes caps each stream; head and tail stay, the drop count is exact."""
    r = client.run(
        "import sys\nsys.stdout.write('A' + 'x' * 99998 + 'Z')\nsys.stderr.write('e' * 5000)",
        max_output_bytes=cap,
    )
    assert r.ok, r
    assert len(r.stdout) <= cap and len(r.stdout) + r.stdout_dropped == 100_000
    assert len(r.stderr) <= cap and len(r.stderr) + r.stderr_dropped == 5000
    if cap:
        assert r.stdout.startswith(b"Ax") and r.stdout.endswith(b"xZ")


def test_unbounded_output_is_capped_at_the_timeout(client: Client) -> None:
    """K5: `yes` without bound: the call times out with its output capped, head and tail kept."""
    r = client.run("yes", language="bash", timeout_s=2)
    assert r.status == "timeout", r
    assert 0 < len(r.stdout) <= OUTPUT_CAP and r.stdout_dropped > 0
    assert r.stdout.startswith(b"y\ny\n") and r.stdout.endswith(b"y\n")
    assert client.run("print('after')").stdout == b"after\n"


@pytest.mark.parametrize(
    ("language", "code"),
    [
        ("python", "import sys\nsys.stdout.buffer.write(sys.stdin.buffer.read())"),
        ("bash", "cat"),
        (
            "c",
            "#include <stdio.h>\nint main(void){char b[65536]; size_t n;"
            " while((n=fread(b,1,sizeof b,stdin))>0) fwrite(b,1,n,stdout); return 0;}",
        ),
    ],
)
def test_a_mebibyte_of_random_bytes_through_stdin_and_stdout(
    client: Client, language: str, code: str
) -> None:
    """K1/K6: 1 MiB of random bytes given as stdin comes back on stdout byte-exact."""
    blob = os.urandom(1 << 20)
    r = client.run(code, language=language, stdin=blob, max_output_bytes=2 << 20)
    assert (r.status, r.exit_code, r.stdout_dropped) == ("exited", 0, 0), r
    assert r.stdout == blob


# --------------------------------------------------------------------------- K2


@pytest.mark.parametrize(
    ("language", "code"),
    [
        ("python", "import time\ntime.sleep(10)"),
        ("python", "while True:\n    pass"),
        (
            "python",
            "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(10)",
        ),
        ("bash", "sleep 10"),
        ("bash", "trap '' TERM; sleep 10 & wait; sleep 10"),
        ("c", "int main(void) { for (;;) {} }"),
    ],
    ids=["py-sleep", "py-spin", "py-ignores-term", "bash-sleep", "bash-ignores-term", "c-spin"],
)
def test_a_call_past_its_timeout_is_timeout(client: Client, language: str, code: str) -> None:
    """K2: past timeout_s a call ends in about 1 s as `timeout`, never with an exit code."""
    t0 = time.monotonic()
    r = client.run(code, language=language, timeout_s=1)
    elapsed = time.monotonic() - t0 - (r.compile.duration_s if r.compile else 0.0)
    assert (r.status, r.exit_code, r.signal, r.stage) == ("timeout", None, None, "run"), r
    assert not r.ok
    assert 0.9 <= elapsed < 2.5, elapsed
    assert 0.9 <= r.duration_s < 2.0, r.duration_s


@pytest.mark.parametrize(
    ("language", "code"),
    [
        (
            "python",
            "import sys, time\nprint('early', flush=True)\n"
            "sys.stderr.write('to-err\\n')\ntime.sleep(10)",
        ),
        ("bash", "echo early; echo to-err >&2; sleep 10"),
    ],
)
def test_output_before_a_timeout_is_kept(client: Client, language: str, code: str) -> None:
    """K2: what the call printed before its timeout is in the result."""
    r = client.run(code, language=language, timeout_s=1)
    assert r.status == "timeout", r
    assert (r.stdout, r.stderr) == (b"early\n", b"to-err\n")


@pytest.mark.parametrize(
    ("language", "code", "code_out"),
    [
        ("bash", "cat", (0, b"")),
        ("bash", "grep x", (1, b"")),
        ("bash", "wc -c", (0, b"0\n")),
        ("bash", "read line; echo $?", (0, b"1\n")),
        ("python", "import sys\nprint(repr(sys.stdin.read()))", (0, b"''\n")),
        ("python", "import sys\nprint(len(sys.stdin.buffer.read()))", (0, b"0\n")),
        ("c", '#include <stdio.h>\nint main(void){printf("%d", getchar()); return 0;}', (0, b"-1")),
    ],
    ids=["cat", "grep", "wc", "read", "py-read", "py-buffer", "c-getchar"],
)
def test_stdin_is_empty_unless_given(
    client: Client, language: str, code: str, code_out: tuple[int, bytes]
) -> None:
    """K2: readers of stdin see end of file at once when the caller gives none."""
    t0 = time.monotonic()
    r = client.run(code, language=language, timeout_s=5)
    spent = time.monotonic() - t0 - (r.compile.duration_s if r.compile else 0.0)
    assert (r.status, r.exit_code, r.stdout) == ("exited", *code_out), r
    assert spent < 2, spent


def test_input_without_stdin_is_eof_error(client: Client) -> None:
    """K2: input() with no stdin raises EOFError at once: exit 1 with its traceback."""
    r = client.run("input()", timeout_s=5)
    assert (r.status, r.exit_code) == ("exited", 1), r
    assert b"EOFError" in r.stderr


@pytest.mark.parametrize(("language", "code"), [("python", "pass"), ("bash", "true")])
def test_stdin_nobody_reads_does_not_block(client: Client, language: str, code: str) -> None:
    """K2: 10 MiB of stdin given to a call that does not read it: the call ends at once."""
    t0 = time.monotonic()
    r = client.run(code, language=language, stdin=b"x" * (10 << 20), timeout_s=20)
    assert r.ok, r
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize(
    ("language", "code"),
    [
        ("bash", "sleep {m} & echo started"),
        ("bash", "setsid sleep {m} & echo started"),
        ("python", "import subprocess\nsubprocess.Popen(['sleep', '{m}'])\nprint('started')"),
        (
            "python",
            "import subprocess\nsubprocess.Popen(['sleep', '{m}'], start_new_session=True)\n"
            "print('started')",
        ),
    ],
    ids=["bash-job", "bash-setsid", "py-popen", "py-new-session"],
)
def test_a_background_process_holding_stdout_does_not_hold_the_call(
    client: Client, language: str, code: str
) -> None:
    """K2/K3: a call that leaves a job holding its stdout returns when it exits; the job dies."""
    m = sleep_marker()
    t0 = time.monotonic()
    r = client.run(code.format(m=m), language=language, timeout_s=20)
    assert (r.status, r.exit_code, r.stdout) == ("exited", 0, b"started\n"), r
    assert time.monotonic() - t0 < 3
    assert not gone_on_host(m), "outlived its call"


@pytest.mark.parametrize(
    ("language", "code", "status"),
    [
        ("bash", "sleep {m} & sleep {m} & wait", "timeout"),
        ("bash", "trap '' TERM; sleep {m} & wait; sleep {m}", "timeout"),
        ("bash", "(sleep {m} &); exit 0", "exited"),
        ("bash", "nohup sh -c 'trap \"\" TERM HUP; sleep {m}' >/dev/null 2>&1 & exit 0", "exited"),
        ("bash", "setsid sh -c 'sleep {m} & exit 0' & exit 0", "exited"),
        (
            "python",
            "import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        os.execvp('sleep', ['sleep', '{m}'])\n    os._exit(0)\nos.wait()",
            "exited",
        ),
        (
            "python",
            "import subprocess, time\nsubprocess.Popen(['sleep', '{m}'], start_new_session=True,"
            " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\ntime.sleep(10)",
            "timeout",
        ),
        (
            "c",
            "#include <unistd.h>\nint main(void){ if (fork() == 0) { setsid();"
            ' execlp("sleep", "sleep", "{m}", (char*)0); } return 0; }',
            "exited",
        ),
    ],
    ids=[
        "children",
        "ignores-term",
        "double-fork",
        "nohup-detached",
        "setsid-daemon",
        "py-double-fork",
        "py-new-session-timeout",
        "c-fork-setsid",
    ],
)
def test_processes_of_a_call_are_gone_before_the_next_call(
    client: Client, language: str, code: str, status: str
) -> None:
    """K2/K3: children and background processes of a call (timed out or not) all die with it."""
    m = sleep_marker()
    r = client.run(code.replace("{m}", m), language=language, timeout_s=1)
    assert r.status == status, r
    assert not gone_on_host(m), "survived its call"
    # the next call of the same pool sees none of them either
    if language == "python":
        seen = client.run(PY_FIND, args=[m])
    elif language == "bash":
        seen = client.run(BASH_FIND, language="bash", args=[m])
    else:
        seen = client.run("int main(void) { return 0; }", language="c")
    assert seen.ok and seen.stdout == b"", seen


def test_fifty_calls_leaving_orphans_leave_no_zombie(client: Client) -> None:
    """K3: 50 calls each leave a short sleep behind; no zombie, no sleep, new calls start."""
    for _ in range(50):
        r = client.run("sleep 0.1 & exit 0", language="bash")
        assert r.ok, r
    r = client.run(
        "for p in /proc/[0-9]*; do s=$(cut -d' ' -f3 $p/stat 2>/dev/null); "
        '[ "$s" = Z ] && echo "zombie $p"; done; ' + BASH_FIND,
        language="bash",
        args=["sleep 0.1"],
    )
    assert r.ok and r.stdout == b"", r


def test_a_hung_call_does_not_block_other_calls(client: Client) -> None:
    """K2: while one call hangs to its timeout, other calls of the same pool answer promptly."""
    hung: dict[str, Any] = {}

    def hang() -> None:
        t0 = time.monotonic()
        hung["result"] = client.run("import time\ntime.sleep(100)", timeout_s=3)
        hung["elapsed"] = time.monotonic() - t0

    thread = threading.Thread(target=hang)
    thread.start()
    time.sleep(0.3)
    slowest = []
    for i in range(5):
        t0 = time.monotonic()
        r = client.run(f"print({i})")
        slowest.append(time.monotonic() - t0)
        assert r.stdout == f"{i}\n".encode(), r
    thread.join(10)
    assert not thread.is_alive()
    # the first may wait for a new worker to start; the rest are warm
    assert slowest[0] < 5 and max(slowest[1:]) < 1, slowest
    assert hung["result"].status == "timeout", hung["result"]
    assert 2.9 <= hung["elapsed"] < 5, hung["elapsed"]


def test_concurrent_calls_each_get_their_own_input_and_output(fncall_dep: LocalDeployment) -> None:
    """K9 for calls: 40 concurrent calls (AsyncClient) each see only their own stdin/env/files."""
    code = (
        "import os, sys\n"
        "data = sys.stdin.read() + '|' + os.environ['TOKEN'] + '|' + open('in.txt').read()\n"
        "open('out.txt', 'w').write(data)\n"
        "print(data + '|' + ','.join(sorted(os.listdir('.'))))\n"
    )

    async def main() -> list[tuple[str, RunResult]]:
        async with AsyncClient(fncall_dep.url, timeout_s=60) as ac:

            async def one(i: int) -> tuple[str, RunResult]:
                token = f"{i}-{secrets.token_hex(4)}"
                r = await ac.run(
                    code,
                    kind="fncall",
                    stdin=f"s{token}",
                    env={"TOKEN": f"e{token}"},
                    files={"in.txt": f"f{token}".encode()},
                    fetch_files=["out.txt"],
                )
                return token, r

            return await asyncio.gather(*(one(i) for i in range(40)))

    for token, r in asyncio.run(main()):
        want = f"s{token}|e{token}|f{token}"
        assert r.ok, r
        assert r.stdout == f"{want}|in.txt,out.txt\n".encode(), (token, r.stdout)
        assert r.files == {"out.txt": want.encode()}


# --------------------------------------------------------------------------- K4


@pytest.mark.parametrize(
    ("code", "exit_code"),
    [
        ("pass", 0),
        ("import sys\nsys.exit(1)", 1),
        ("import sys\nsys.exit(3)", 3),
        ("import sys\nsys.exit(255)", 255),
        ("raise SystemExit(42)", 42),
        ("import sys\nsys.exit(None)", 0),
        ("import os\nos._exit(7)", 7),
        ("import sys\nsys.exit(256 + 5)", 5),
    ],
)
def test_python_exit_codes(client: Client, code: str, exit_code: int) -> None:
    """K4: sys.exit(n), SystemExit and os._exit give exactly the exit code python3 -c gives."""
    r = client.run(code)
    assert (r.status, r.exit_code, r.signal) == ("exited", exit_code, None), r
    assert r.ok == (exit_code == 0)


def test_sys_exit_with_a_message_is_1_with_the_message(client: Client) -> None:
    """K4: sys.exit("msg") exits 1 with the message on stderr, as python3 -c does."""
    r = client.run("import sys\nsys.exit('bad input')")
    assert (r.status, r.exit_code, r.stderr, r.stdout) == ("exited", 1, b"bad input\n", b""), r


def test_an_uncaught_exception_is_1_with_the_traceback_of_python_c(client: Client) -> None:
    """K4: an uncaught exception exits 1 with the traceback python3 -c prints, nothing more."""
    r = client.run("print('before')\ndef f():\n    raise ValueError('boom')\nf()")
    assert (r.status, r.exit_code, r.stdout) == ("exited", 1, b"before\n"), r
    assert r.stderr == (
        b"Traceback (most recent call last):\n"
        b'  File "<string>", line 4, in <module>\n'
        b'  File "<string>", line 3, in f\n'
        b"ValueError: boom\n"
    ), r.stderr_text


def test_a_syntax_error_is_1_with_a_message(client: Client) -> None:
    """K4: code that does not compile is exit 1 with a SyntaxError on stderr, not an error."""
    r = client.run("def f(:\n    pass")
    assert (r.status, r.exit_code) == ("exited", 1), r
    assert b"SyntaxError" in r.stderr


@pytest.mark.parametrize(
    ("language", "code", "sig"),
    [
        ("python", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", 11),
        ("python", "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)", 15),
        ("python", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", 9),
        ("python", "import ctypes\nctypes.string_at(0)", 11),
        ("bash", "kill -SEGV $$", 11),
        ("bash", "kill -9 $$", 9),
        ("bash", "kill -TERM $$", 15),
        ("c", "#include <signal.h>\nint main(void){ raise(SIGSEGV); return 0; }", 11),
        ("c", "#include <stdlib.h>\nint main(void){ abort(); }", 6),
        ("cpp", '#include <stdexcept>\nint main(){ throw std::runtime_error("x"); }', 6),
    ],
    ids=[
        "py-segv",
        "py-term",
        "py-kill",
        "py-null-deref",
        "bash-segv",
        "bash-kill",
        "bash-term",
        "c-segv",
        "c-abort",
        "cpp-uncaught",
    ],
)
def test_death_by_signal_is_reported_as_such(
    client: Client, language: str, code: str, sig: int
) -> None:
    """K4: death by a signal is `signaled` with its number, no exit code (SIGKILL is no OOM)."""
    r = client.run(code, language=language)
    assert (r.status, r.exit_code, r.signal, r.stage) == ("signaled", None, sig, "run"), r
    assert not r.ok


@pytest.mark.parametrize(
    ("language", "code", "exit_code"),
    [
        ("bash", "exit 3", 3),
        ("bash", "false", 1),
        ("bash", "exit 255", 255),
        ("bash", "exit 137", 137),
        ("bash", "true", 0),
        ("c", "int main(void){ return 3; }", 3),
        ("c", "#include <stdlib.h>\nint main(void){ exit(255); }", 255),
        ("cpp", "int main(){ return 300; }", 44),
    ],
)
def test_exit_codes_are_reported_exactly(
    client: Client, language: str, code: str, exit_code: int
) -> None:
    """K4: an exit code is `exited` with that exact code (137 is no signal)."""
    r = client.run(code, language=language)
    assert (r.status, r.exit_code, r.signal) == ("exited", exit_code, None), r


def test_a_missing_command_is_127_with_a_message(client: Client) -> None:
    """K4: a command that does not exist exits 127 with a message naming it."""
    r = client.run("no-such-command-x --flag", language="bash")
    assert (r.status, r.exit_code) == ("exited", 127), r
    assert b"no-such-command-x" in r.stderr


# --------------------------------------------------------------------------- like python3 -c

#: Programs whose every observable (status, exit code, signal, stdout, stderr) must be what
#: the image's own `python3 -c` gives, run by a bash call in the same kind of worker.
LIKE_PYTHON_C = {
    "name-main": ("if __name__ == '__main__':\n    print(__name__, __spec__, __doc__)", b""),
    "argv-path": ("import sys\nprint(sys.argv, repr(sys.path[0]))", b""),
    "stdio-setup": (
        "import sys\nprint([(s.encoding, s.errors, s.line_buffering)"
        " for s in (sys.stdin, sys.stdout, sys.stderr)])",
        b"",
    ),
    "stdin-not-utf8": ("import sys\nprint(repr(sys.stdin.read()))", b"a\xffb"),
    "echo-not-utf8": ("import sys\nsys.stdout.write(sys.stdin.read())", b"\xfe\xff\n"),
    "closed-stdout": ("import sys\nprint('x')\nsys.stdout.close()", b""),
    "exit-odd-values": ("import sys\nsys.exit(-1)", b""),
    "exit-float": ("import sys\nsys.exit(3.5)", b""),
    "exit-true": ("import sys\nsys.exit(True)", b""),
    "site-exit": ("exit(4)", b""),
    "input-prompt": ("print(input('name? ').upper())", b"bob\n"),
    "warning": ("import warnings\nwarnings.warn('careful')", b""),
    "zero-division": ("print(1 / 0)", b""),
    "thread-joined": (
        "import threading, time\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()",
        b"",
    ),
    "multiprocessing": (
        "import multiprocessing as mp\nwith mp.Pool(2) as p:\n    print(p.map(abs, [-1, -2]))",
        b"",
    ),
    "signal-dispositions": (
        "import signal\nprint([signal.getsignal(s) for s in"
        " (signal.SIGINT, signal.SIGPIPE, signal.SIGTERM, signal.SIGCHLD)])",
        b"",
    ),
    "broken-pipe": (
        "import subprocess\n"
        "p = subprocess.Popen(['head', '-c', '1'], stdin=subprocess.PIPE,"
        " stdout=subprocess.DEVNULL)\n"
        "try:\n    p.stdin.write(b'x' * 1000000)\n    p.stdin.flush()\n"
        "except BrokenPipeError:\n    print('broken pipe')\n"
        "p.wait()\n",
        b"",
    ),
    "keyboard-interrupt": ("raise KeyboardInterrupt", b""),
    "sigint": ("import os, signal\nos.kill(os.getpid(), signal.SIGINT)", b""),
}


@pytest.mark.parametrize("name", list(LIKE_PYTHON_C))
def test_a_python_call_behaves_as_python3_c(client: Client, name: str) -> None:
    """Python calls run "like python3 -c": the same program, the same stdin, the same result."""
    code, stdin = LIKE_PYTHON_C[name]
    call = client.run(code, stdin=stdin, timeout_s=10)
    ref = client.run(
        'exec python3 -c "$1"', language="bash", args=[code], stdin=stdin, timeout_s=10
    )
    seen = (call.status, call.exit_code, call.signal, call.stdout, call.stderr_text)
    want = (ref.status, ref.exit_code, ref.signal, ref.stdout, ref.stderr_text)
    assert seen == want


# --------------------------------------------------------------------------- K6

VALUES = ["hello world", "a\nb", "$HOME", "it's", "", "ü", " lead and trail ", "a=b;c|d&`e`"]


def test_args_arrive_without_a_shell(client: Client) -> None:
    """K6: args are argv[1:] untouched (sys.argv = ['-c', *args]; bash's $0 is bash)."""
    args = [*VALUES, "*", "~"]
    r = client.run("import sys\nsys.stdout.buffer.write('\\0'.join(sys.argv).encode())", args=args)
    assert r.ok and r.stdout == "\0".join(["-c", *args]).encode(), r
    r = client.run('printf \'%s\\0\' "$0" "$@"', language="bash", args=args)
    assert r.ok and r.stdout == "".join(a + "\0" for a in ["bash", *args]).encode(), r
    code = (
        "#include <stdio.h>\n#include <string.h>\n"
        "int main(int argc, char **argv){ for (int i = 1; i < argc; i++)"
        " fwrite(argv[i], 1, strlen(argv[i]) + 1, stdout); return 0; }"
    )
    r = client.run(code, language="c", args=args)
    assert r.ok and r.stdout == "".join(a + "\0" for a in args).encode(), r


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_env_values_arrive_byte_identical(client: Client, value: str) -> None:
    """K6: an env value prints back byte-identical in python, bash and C."""
    want = value.encode()
    r = client.run("import os, sys\nsys.stdout.buffer.write(os.environb[b'V'])", env={"V": value})
    assert r.ok and r.stdout == want, r
    r = client.run('printf %s "$V"', language="bash", env={"V": value})
    assert r.ok and r.stdout == want, r
    r = client.run(
        '#include <stdio.h>\n#include <stdlib.h>\nint main(void){ fputs(getenv("V"), stdout); }',
        language="c",
        env={"V": value},
    )
    assert r.ok and r.stdout == want, r


def test_the_call_runs_in_tmp_with_home_tmp(client: Client) -> None:
    """K6: the working directory is /tmp and HOME=/tmp; the caller's env adds to PATH & co."""
    r = client.run("import os\nprint(os.getcwd(), os.environ['HOME'], 'PATH' in os.environ)")
    assert r.stdout == b"/tmp /tmp True\n", r
    r = client.run('echo "$PWD $HOME"', language="bash")
    assert r.stdout == b"/tmp /tmp\n", r


@pytest.mark.parametrize("bad", [{"V": "a\0b"}, {"A=B": "x"}, {"": "x"}], ids=repr)
def test_env_that_cannot_be_passed_is_refused(client: Client, bad: dict[str, str]) -> None:
    """K6: an env a process cannot receive is InvalidArgument, not a mangled value."""
    with pytest.raises(errors.InvalidArgument):
        client.run("pass", env=bad)


def test_stdin_as_text_is_utf8(client: Client) -> None:
    """K6: stdin given as str arrives UTF-8 encoded."""
    r = client.run("import sys\nsys.stdout.buffer.write(sys.stdin.buffer.read())", stdin="ü\n")
    assert r.ok and r.stdout == "ü\n".encode(), r


# --------------------------------------------------------------------------- K7


def test_files_and_fetch_files_round_trip(client: Client) -> None:
    """K7: files (binary, empty, in subdirectories, absolute under /tmp) arrive and come back."""
    blob = os.urandom(1 << 20)
    files = {
        "in.bin": blob,
        "empty": b"",
        "sub/dir/deep.txt": b"deep",
        "name with space.txt": b"space",
        "ü.txt": "ü".encode(),
    }
    code = (
        "import os\n"
        "os.makedirs('out/nested/deep')\n"
        "open('out/copy.bin', 'wb').write(open('in.bin', 'rb').read()[::-1])\n"
        "open('out/nested/deep/x.txt', 'wb').write(open('sub/dir/deep.txt', 'rb').read() * 2)\n"
        "open('/tmp/out/empty', 'wb').close()\n"
        "print(os.path.getsize('empty'), open('/tmp/sub/dir/deep.txt').read(),"
        " open('ü.txt').read())\n"
    )
    outputs = {
        "out/copy.bin": blob[::-1],
        "out/nested/deep/x.txt": b"deepdeep",
        "out/empty": b"",
    }
    fetch = [*files, *outputs]
    r = client.run(code, files=files, fetch_files=fetch, timeout_s=20)
    assert r.ok, r
    assert r.stdout == "0 deep ü\n".encode()
    assert (r.missing_files, r.fetch_errors) == ([], {})
    assert set(r.files) == set(fetch)
    for path, want in {**files, **outputs}.items():
        assert r.files[path] == want, path


def test_absolute_paths_under_tmp_come_back_under_the_name_asked(client: Client) -> None:
    """K7: files and fetch_files may be absolute under /tmp; results are keyed as requested."""
    r = client.run(
        "import os\nos.makedirs('/tmp/o')\n"
        "open('/tmp/o/out.txt', 'w').write(open('abs.txt').read())",
        files={"/tmp/abs.txt": b"abs"},
        fetch_files=["/tmp/abs.txt", "/tmp/o/out.txt", "/tmp/none.txt"],
    )
    assert r.ok, r
    assert r.files == {"/tmp/abs.txt": b"abs", "/tmp/o/out.txt": b"abs"}, sorted(r.files)
    assert r.missing_files == ["/tmp/none.txt"], r.missing_files


def test_bash_files_round_trip(client: Client) -> None:
    """K7: the same in bash: an input file is read, an output in a new directory comes back."""
    r = client.run(
        "mkdir -p a/b && tr a-z A-Z < in.txt > a/b/out.txt",
        language="bash",
        files={"in.txt": b"hello\n"},
        fetch_files=["a/b/out.txt"],
    )
    assert r.ok, r
    assert r.files == {"a/b/out.txt": b"HELLO\n"}


def test_a_call_may_change_its_input_files(client: Client) -> None:
    """K7: files given to the call are its own: it can rewrite them and the new bytes return."""
    r = client.run(
        "open('in.txt', 'a').write('+more')\nopen('sub/in.txt', 'w').write('new')",
        files={"in.txt": b"data", "sub/in.txt": b"old"},
        fetch_files=["in.txt", "sub/in.txt"],
    )
    assert r.ok, r
    assert r.files == {"in.txt": b"data+more", "sub/in.txt": b"new"}


def test_a_missing_fetch_file_is_listed_not_an_error(client: Client) -> None:
    """K7: fetch files the call did not make are in missing_files; the others come back."""
    r = client.run(
        "import os\nopen('here.txt', 'w').write('here')\nos.mkdir('adir')",
        fetch_files=["here.txt", "nope.txt", "sub/nope", "adir"],
    )
    assert r.ok, r
    assert r.files == {"here.txt": b"here"}
    assert sorted(r.missing_files) == ["adir", "nope.txt", "sub/nope"]


def test_a_symlink_out_of_tmp_is_not_fetched(client: Client) -> None:
    """K7: a fetch file that is a symlink out of /tmp (to a root-only file) does not come back."""
    code = (
        "import os\n"
        "os.symlink('/etc/shadow', 'shadow')\n"
        "os.symlink('/proc/1/environ', 'environ')\n"
        "os.symlink('../etc/passwd', 'passwd')\n"
        "os.symlink('/proc/self/root/etc/shadow', 'viaproc')\n"
        "os.mkdir('d')\nos.symlink('/etc', 'd/etc')\n"
    )
    fetch = ["shadow", "environ", "passwd", "viaproc", "d/etc/shadow"]
    r = client.run(code, fetch_files=fetch)
    assert r.ok, r
    assert r.files == {}, sorted(r.files)
    assert sorted(r.missing_files + list(r.fetch_errors)) == sorted(fetch)


@pytest.mark.parametrize(
    "path", ["../x", "/etc/x", "a/../../x", "/tmp/../etc/x", "/x", ""], ids=repr
)
@pytest.mark.parametrize("where", ["files", "fetch_files"])
def test_a_path_outside_tmp_is_refused_before_running(
    client: Client, path: str, where: str
) -> None:
    """K7: a file path outside /tmp is InvalidArgument saying what to change, before running."""
    kwargs: dict[str, Any] = (
        {"files": {path: b"x"}} if where == "files" else {"fetch_files": [path]}
    )
    t0 = time.monotonic()
    with pytest.raises(errors.InvalidArgument) as info:
        client.run("import time\ntime.sleep(5)", **kwargs)
    assert time.monotonic() - t0 < 2
    message = str(info.value)
    assert where in message and repr(path) in message, message


# --------------------------------------------------------------------------- invalid requests


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"language": "cobol"}, "language"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"timeout_s": float("inf")}, "timeout_s"),
        ({"timeout_s": 100_000}, "timeout_s"),
        ({"compile_timeout_s": 0}, "compile_timeout_s"),
        ({"memory_mb": 1}, "memory_mb"),
        ({"max_output_bytes": -1}, "max_output_bytes"),
    ],
    ids=lambda v: repr(v) if not isinstance(v, str) else v,
)
def test_an_invalid_request_is_refused_before_running(
    client: Client, kwargs: dict[str, Any], field: str
) -> None:
    """K2/K6: an unknown language or an impossible limit is InvalidArgument naming the field."""
    t0 = time.monotonic()
    with pytest.raises(errors.InvalidArgument, match=field):
        client.run("import time\ntime.sleep(5)", **kwargs)
    assert time.monotonic() - t0 < 2


def test_an_unknown_image_is_not_found(client: Client) -> None:
    """Same errors as the other kinds: an image that does not exist is NotFound naming it."""
    with pytest.raises(errors.NotFound, match="no/such-image:1"):
        client.run("print(1)", image="no/such-image:1")


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"code": "print(1)", "language": "cobol"}, 400, "INVALID_ARGUMENT"),
        ({"code": "print(1)", "timeout_s": 0}, 400, "INVALID_ARGUMENT"),
        ({"code": "print(1)", "fetch_files": ["../x"]}, 400, "INVALID_ARGUMENT"),
        ({"language": "python"}, 400, "INVALID_ARGUMENT"),
        ({"code": "print(1)", "image": "no/such-image:1"}, 404, "NOT_FOUND"),
    ],
    ids=["language", "timeout", "path", "no-code", "image"],
)
def test_http_errors_are_in_the_sandfleet_format(
    fncall_dep: LocalDeployment, body: dict[str, Any], status: int, code: str
) -> None:
    """Same errors as the other kinds over HTTP: status and {"error": {"code", "message"}}."""
    resp = httpx.post(f"{fncall_dep.url}/v1/run", json=body, timeout=30)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == code and err["message"], err


def test_http_run_answers_a_run_result(fncall_dep: LocalDeployment) -> None:
    """The one-shot HTTP API: POST /v1/run answers the RunResult JSON (bytes as base64)."""
    resp = httpx.post(
        f"{fncall_dep.url}/v1/run",
        json={"code": "import sys\nsys.stdout.buffer.write(b'\\xe2\\0')", "language": "python"},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    r = RunResult.model_validate_json(resp.content)
    assert (r.status, r.exit_code, r.stdout, r.stage) == ("exited", 0, b"\xe2\0", "run")
    assert json.loads(resp.content)["worker"]


# --------------------------------------------------------------------------- K5

MEMORY_MB = 64


@pytest.mark.parametrize(
    ("language", "code"),
    [
        ("python", f"x = b'x' * ({MEMORY_MB * 3} << 20)\nprint(len(x))"),
        ("python", "a = []\nwhile True:\n    a.append(bytearray(1 << 20))"),
        ("bash", f"x=$(head -c {MEMORY_MB * 3}000000 /dev/zero | tr '\\0' a); echo ${{#x}}"),
        (
            "c",
            "#include <stdio.h>\n#include <stdlib.h>\n"
            f"int main(void){{ size_t n = (size_t){MEMORY_MB * 3} << 20;"
            " volatile char *p = malloc(n); if (!p) return 2;"
            " for (size_t i = 0; i < n; i += 4096) p[i] = 1;"
            ' printf("%d", p[n / 2]); return 0; }',
        ),
    ],
    ids=["py-bytes", "py-list", "bash-variable", "c-malloc"],
)
def test_memory_over_the_limit_is_oom_and_the_pool_survives(
    client: Client, language: str, code: str
) -> None:
    """K5: touching 3x memory_mb ends as `oom` (no exit code); the next call runs normally."""
    for _ in range(2):
        r = client.run(code, language=language, memory_mb=MEMORY_MB, timeout_s=30)
        assert (r.status, r.exit_code, r.stage) == ("oom", None, "run"), r
        assert not r.ok
        after = client.run("echo alive", language="bash")
        assert after.stdout == b"alive\n", after
        again = client.run("print('alive')", memory_mb=MEMORY_MB)
        assert again.stdout == b"alive\n", again


def test_memory_mb_is_per_call(client: Client) -> None:
    """K5: the same 100 MiB allocation is fine with 256 MiB and oom with 64 MiB, half fits."""
    code = "x = b'x' * (100 << 20)\nprint(len(x) >> 20)"
    assert client.run(code, memory_mb=256).stdout == b"100\n"
    assert client.run(code, memory_mb=MEMORY_MB).status == "oom"
    assert client.run(code, memory_mb=256).stdout == b"100\n"
    half = client.run(f"x = b'x' * ({MEMORY_MB // 2} << 20)\nprint('fits')", memory_mb=MEMORY_MB)
    assert (half.status, half.exit_code, half.stdout) == ("exited", 0, b"fits\n"), half


@pytest.mark.parametrize(
    ("language", "code"),
    [
        ("bash", "b() { b | b & }; b; sleep 30"),
        (
            "python",
            "import os\nwhile True:\n    try:\n        os.fork()\n"
            "    except OSError:\n        pass",
        ),
    ],
    ids=["bash", "python"],
)
def test_a_fork_bomb_is_contained(client: Client, language: str, code: str) -> None:
    """K5: a fork bomb ends (timeout or a failure) within its timeout; the next call works."""
    t0 = time.monotonic()
    try:
        r: RunResult | errors.SandfleetError = client.run(code, language=language, timeout_s=3)
    except errors.SandfleetError as exc:  # a clean error is acceptable; a hang is not
        r = exc
    assert time.monotonic() - t0 < 8
    if isinstance(r, RunResult):
        assert not r.ok and r.status in ("timeout", "exited", "signaled", "oom"), r
    for lang, probe in (("python", "print('recovered')"), ("bash", "echo recovered")):
        t1 = time.monotonic()
        again = client.run(probe, language=lang, timeout_s=10)
        assert again.stdout == b"recovered\n", again
        assert time.monotonic() - t1 < 5


def test_the_process_limit_is_enforced(client: Client) -> None:
    """K5: forking until it fails stops at a process limit well below 10,000."""
    code = (
        "import os, signal\n"
        "n = 0\n"
        "try:\n"
        "    while n < 10000:\n"
        "        if os.fork() == 0:\n"
        "            signal.pause()\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print('stopped', n, e.errno)\n"
    )
    r = client.run(code, timeout_s=10, memory_mb=512)
    assert r.ok, r
    words = r.stdout.split()
    assert words[0] == b"stopped" and int(words[1]) < 10000, r.stdout
    assert client.run("print('after')").stdout == b"after\n"


def test_cpu_is_limited(client: Client) -> None:
    """K5: four spinning processes for 1.5 s cannot take every core of the node."""
    code = (
        "import os, time\n"
        "pids = []\n"
        "for _ in range(4):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        end = time.monotonic() + 1.5\n"
        "        while time.monotonic() < end:\n"
        "            pass\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "t0 = time.monotonic()\n"
        "for pid in pids:\n"
        "    os.waitpid(pid, 0)\n"
        "wall = time.monotonic() - t0\n"
        "t = os.times()\n"
        "print(wall, t.children_user + t.children_system)\n"
    )
    r = client.run(code, timeout_s=10)
    assert r.ok, r
    wall, cpu = (float(x) for x in r.stdout.split())
    cores = os.cpu_count() or 1
    assert cpu <= (cores - 0.5) * wall, (cores, wall, cpu)


@pytest.mark.parametrize(
    ("language", "code"),
    [
        ("python", "open('/etc/x', 'w')"),
        ("python", "open('/usr/lib/python3.11/os.py', 'a')"),
        ("python", "import os\nos.mkdir('/var/tmp/x')"),
        ("bash", "echo x > /etc/x"),
        ("bash", "touch /usr/bin/x"),
    ],
)
def test_the_root_is_read_only(client: Client, language: str, code: str) -> None:
    """K5/K10: the image's root cannot be written (nor its stdlib poisoned for later calls)."""
    r = client.run(code, language=language)
    assert r.status == "exited" and r.exit_code not in (0, None), r
    assert r.stderr, r


def test_there_is_no_network(client: Client, fncall_dep: LocalDeployment) -> None:
    """K10: a call reaches no address: not the internet, not the node agent nor control plane."""
    addrs = [("1.1.1.1", 53), ("8.8.8.8", 443), ("10.0.0.1", 80), ("192.168.1.1", 80)]
    hosts = {"127.0.0.1"}
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            hosts.add(s.getsockname()[0])
    except OSError:
        pass
    for port in (fncall_dep.port, fncall_dep.node_port):
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
        addrs += [(h, port) for h in sorted(hosts)]
    code = (
        "import json, socket, sys\n"
        "out = {}\n"
        "for host, port in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=1).close()\n"
        "        out['%s:%d' % (host, port)] = 'connected'\n"
        "    except OSError as e:\n"
        "        out['%s:%d' % (host, port)] = 'refused: %s' % e\n"
        "try:\n"
        "    socket.getaddrinfo('example.com', 80)\n"
        "    out['dns'] = 'resolved'\n"
        "except OSError as e:\n"
        "    out['dns'] = 'refused: %s' % e\n"
        "out['links'] = sorted(l.split(':')[0].strip()"
        " for l in open('/proc/net/dev').read().splitlines()[2:])\n"
        "print(json.dumps(out))\n"
    )
    r = client.run(code, args=[json.dumps(addrs)], timeout_s=30)
    assert r.ok, r
    out = json.loads(r.stdout)
    assert out.pop("links") == ["lo"], out
    connected = {k: v for k, v in out.items() if not v.startswith("refused")}
    assert not connected, connected


def test_no_socket_or_descriptor_of_the_node_reaches_a_call(client: Client) -> None:
    """K10: a call holds only fds 0-2, and no unix socket on its filesystem accepts it."""
    code = (
        "import os, socket, stat\n"
        "fds = []\n"
        "for fd in range(3, 4096):\n"
        "    try:\n"
        "        os.fstat(fd)\n"
        "        fds.append(fd)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('fds', fds)\n"
        "for top, dirs, files in os.walk('/'):\n"
        "    if top in ('/proc', '/sys'):\n"
        "        dirs[:] = []\n"
        "        continue\n"
        "    for name in files:\n"
        "        p = os.path.join(top, name)\n"
        "        try:\n"
        "            if not stat.S_ISSOCK(os.lstat(p).st_mode):\n"
        "                continue\n"
        "        except OSError:\n"
        "            continue\n"
        "        s = socket.socket(socket.AF_UNIX)\n"
        "        try:\n"
        "            s.connect(p)\n"
        "            print('connected', p)\n"
        "        except OSError as e:\n"
        "            print('socket', p, e.errno)\n"
        "        s.close()\n"
    )
    r = client.run(code, timeout_s=30)
    assert r.ok, r
    lines = r.stdout_text.splitlines()
    assert lines[0] == "fds []", lines[0]
    assert not [line for line in lines if line.startswith("connected")], lines


@pytest.mark.parametrize(
    "path",
    ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/sys/firmware"],
)
def test_sensitive_kernel_paths_are_masked(client: Client, path: str) -> None:
    """K10: sensitive /proc and /sys paths read as nothing from a call."""
    r = client.run(
        f"cat {path} 2>/dev/null | head -c 64; ls -A {path} 2>/dev/null | head -c 64",
        language="bash",
    )
    assert r.stdout in (b"", f"{path}\n".encode()), r.stdout[:64]


def test_a_timeout_of_a_fraction_of_a_second_is_honoured(client: Client) -> None:
    """K2: timeout_s is not rounded up to whole seconds."""
    t0 = time.monotonic()
    r = client.run("import time\ntime.sleep(5)", timeout_s=0.3)
    assert r.status == "timeout", r
    assert time.monotonic() - t0 < 1.5
