"""fncall workers: what one call leaves never reaches the next, and the pools hold up.

Issue 4, item 2: between calls a worker is scrubbed (files, environment,
processes, imported modules, IPC); a call that crashes or exhausts its worker
gets a correct status and the worker is replaced; calls run as ``nobody``
and cannot touch the worker's PID 1. Item 1/3: C and C++ compile and run as
one call; pools have counters, bounds and a bounded queue.

The python pool runs with one worker in this module, so call B runs in the
worker call A just left (or in its replacement): what B sees is exactly what
the scrub left behind.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import platform
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandfleet import errors
from sandfleet.cli.local import LocalDeployment
from sandfleet.sdk import AsyncClient, Client
from sandfleet.wire.models import FNCALL_IMAGE, PoolInfo, RunResult
from tests.conftest import FnClient

pytestmark = pytest.mark.root

NOBODY = 65534


@pytest.fixture(scope="module")
def client(fncall_dep: LocalDeployment) -> Iterator[Client]:
    """A client whose python pool has exactly one worker: call B follows call A in it."""
    with FnClient(fncall_dep.url, timeout_s=60) as c:
        infos = c.configure_pool(
            image=FNCALL_IMAGE,
            language="python",
            min_workers=1,
            max_workers=1,
            max_queue=4096,
            idle_s=60,
        )
        assert infos and all(i.max_workers == 1 and i.min_workers == 1 for i in infos), infos
        yield c


def pool(client: Client, language: str = "python") -> PoolInfo:
    """The pool of ``language`` for the fncall image on the deployment's only node."""
    found = [p for p in client.pools() if p.image == FNCALL_IMAGE and p.language == language]
    assert len(found) == 1, client.pools()
    return found[0]


def wait_pool(client: Client, language: str, ok: Any, seconds: float = 15.0) -> PoolInfo:
    """Poll the pool of ``language`` until ``ok(info)``; its last state if that never happens."""
    deadline = time.monotonic() + seconds
    while True:
        info = pool(client, language)
        if ok(info) or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def host_processes(marker: str) -> list[int]:
    """Host pids of processes whose command line contains ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def gone_on_host(marker: str, seconds: float = 1.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while True:
        left = host_processes(marker)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def sleep_marker() -> str:
    """A `sleep` duration no other process on the host uses, e.g. ``9123.456789``."""
    return f"9{secrets.randbelow(1000):03d}.{secrets.randbelow(10**6):06d}"


def run_ok(client: Client, code: str, **kwargs: Any) -> RunResult:
    r = client.run(code, **kwargs)
    assert r.ok, r
    return r


# --------------------------------------------------------------------------- files

WRITE_EVERYWHERE = """
import os, stat
open('/tmp/a.txt', 'w').write('secret-a')
open('/tmp/.hidden', 'w').write('secret-h')
os.makedirs('/tmp/sub/dir')
open('/tmp/sub/dir/f', 'w').write('secret-f')
open('rel.txt', 'w').write('secret-r')
open('/tmp/nl\\nname', 'w').write('secret-n')
os.makedirs('/tmp/locked/inner')
open('/tmp/locked/inner/x', 'w').write('secret-l')
os.chmod('/tmp/locked', 0)
os.mkfifo('/tmp/fifo')
os.symlink('/etc/passwd', '/tmp/link')
open('/tmp/ro', 'w').write('secret-ro')
os.chmod('/tmp/ro', 0o400)
open('/dev/shm/sf', 'w').write('secret-shm')
os.makedirs('/dev/shm/d/e')
print('written')
"""

LIST_TMP = """
import json, os
print(json.dumps({d: sorted(os.listdir(d)) for d in ('/tmp', '/dev/shm')}))
"""


def test_files_written_by_a_call_are_gone_in_the_next(client: Client) -> None:
    """Files, directories (even mode 000), FIFOs and links left in /tmp and /dev/shm are gone."""
    a = run_ok(client, WRITE_EVERYWHERE)
    assert a.stdout == b"written\n"
    b = run_ok(client, LIST_TMP)
    assert json.loads(b.stdout) == {"/tmp": [], "/dev/shm": []}, (a.worker, b.worker, b.stdout)


def test_files_written_by_a_bash_call_are_gone_in_the_next(client: Client) -> None:
    """The same in bash: what a call leaves in /tmp, /dev/shm and its cwd is gone."""
    a = client.run(
        "echo s > /tmp/f; mkdir -p /dev/shm/d; echo s > rel; export LEAK=1; cd /; echo done",
        language="bash",
    )
    assert a.stdout == b"done\n", a
    b = client.run('ls -A /tmp /dev/shm; echo "${LEAK-unset}"; pwd', language="bash")
    assert b.stdout == b"/dev/shm:\n\n/tmp:\nunset\n/tmp\n", b.stdout_text


def test_nothing_written_anywhere_survives_the_call(client: Client) -> None:
    """Call A writes a file in every directory it can; call B finds none of them."""
    tok = secrets.token_hex(6)
    a = client.run(
        "import os, sys\n"
        "made = []\n"
        "for top, dirs, files in os.walk('/'):\n"
        "    if top in ('/proc', '/sys'):\n"
        "        dirs[:] = []\n"
        "        continue\n"
        "    p = os.path.join(top, '.sf-' + sys.argv[1])\n"
        "    try:\n"
        "        os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))\n"
        "        made.append(p)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('\\n'.join(made))\n",
        args=[tok],
        timeout_s=30,
    )
    assert a.ok, a
    made = a.stdout_text.split()
    assert "/tmp/.sf-" + tok in made, made
    b = run_ok(
        client,
        "import json, os, sys\nprint(json.dumps([p for p in json.loads(sys.argv[1])"
        " if os.path.lexists(p)]))",
        args=[json.dumps(made)],
    )
    assert json.loads(b.stdout) == [], f"seen by the next call; A could write in {made}"


def test_tmp_filled_by_a_call_is_given_back(client: Client) -> None:
    """A call that fills /tmp (charged to its memory) leaves the next call all of its memory."""
    fill = client.run(
        "import os\nwith open('/tmp/big', 'wb') as f:\n    while True:\n"
        "        f.write(b'x' * (1 << 20))\n",
        memory_mb=64,
        timeout_s=20,
    )
    assert not fill.ok and fill.status in ("oom", "exited"), fill
    for _ in range(2):
        r = client.run("x = b'x' * (40 << 20)\nprint('fits')", memory_mb=64)
        assert (r.status, r.stdout) == ("exited", b"fits\n"), r


# --------------------------------------------------------------------------- interpreter state

STATE = """
import builtins, collections, json, os, sys
print(json.dumps({
    'environ': dict(os.environ),
    'cwd': os.getcwd(),
    'umask': os.umask(0o022),
    'path': sys.path,
    'recursion': sys.getrecursionlimit(),
    'dumps': json.dumps({'a': 1}),
    'len': len([1, 2]),
    'od': collections.OrderedDict.__name__,
    'argv': sys.argv,
    'main': sorted(k for k in vars(sys.modules['__main__']) if not k.startswith('__')),
    'builtins': sorted(vars(builtins)),
}))
"""

MESS = """
import builtins, collections, json, os, sys
os.environ['SF_LEAK'] = 'x'
os.putenv('SF_LEAK2', 'y')
os.environ['PATH'] = '/tmp/evil'
os.chdir('/')
os.umask(0o777)
sys.path.insert(0, '/tmp/evil')
sys.setrecursionlimit(77)
json.dumps = lambda *a, **k: 'pwned'
collections.OrderedDict = dict
builtins.len = lambda x: -1
builtins.sf_leak = 'x'
sys.argv.append('leaked')
leaked_global = 1
"""


def test_environment_and_interpreter_state_do_not_leak(client: Client) -> None:
    """env, cwd, umask, sys.path, monkeypatched stdlib and builtins of A are gone in B."""
    before = json.loads(run_ok(client, STATE).stdout)
    assert before["cwd"] == "/tmp" and "SF_LEAK" not in before["environ"]
    client.run(MESS)  # its own exit status may suffer from its len(); the next call may not
    after = json.loads(run_ok(client, STATE).stdout)
    assert after == before


def test_environment_of_a_bash_call_does_not_leak(client: Client) -> None:
    """A bash call's exports, umask and aliases do not reach the next bash call."""
    before = client.run("env | sort; umask; pwd", language="bash")
    client.run("export SF_LEAK=1; umask 077; cd /; alias ls=false", language="bash")
    after = client.run("env | sort; umask; pwd", language="bash")
    assert after.stdout == before.stdout and b"SF_LEAK" not in after.stdout


MODULES = "import sys\nprint(sorted(sys.modules))"


def test_modules_imported_by_a_call_are_gone_in_the_next(client: Client) -> None:
    """Stdlib modules and a module file imported by A are not in B's sys.modules."""
    name = f"sfmod_{secrets.token_hex(4)}"
    before = ast.literal_eval(run_ok(client, MODULES).stdout_text)
    a = run_ok(
        client,
        f"import sys\nopen('/tmp/{name}.py', 'w').write('X = 1')\nsys.path.insert(0, '/tmp')\n"
        f"import {name}, sqlite3, wave, tomllib, xml.dom.minidom, http.client, email.mime.text\n"
        f"print({name}.X, sorted(set(sys.modules) - set({before!r})))",
    )
    assert a.stdout.startswith(b"1 ") and b"sqlite3" in a.stdout, a
    after = ast.literal_eval(run_ok(client, MODULES).stdout_text)
    assert after == before, sorted(set(after) ^ set(before))


# --------------------------------------------------------------------------- processes


def test_background_processes_of_a_call_are_gone_in_the_next(client: Client) -> None:
    """A's detached sleep, double-forked daemon and TERM-ignoring child are gone for B."""
    m = sleep_marker()
    t0 = time.monotonic()
    a = client.run(
        "import os, signal, subprocess, sys\n"
        "m = sys.argv[1]\n"
        "subprocess.Popen(['sleep', m], start_new_session=True)\n"
        "subprocess.Popen(['sh', '-c', 'trap \"\" TERM HUP INT; sleep ' + m],"
        " start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.execvp('sleep', ['sleep', m])\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "print('started')\n",
        args=[m],
    )
    assert (a.status, a.stdout) == ("exited", b"started\n"), a
    assert time.monotonic() - t0 < 3
    b = run_ok(
        client,
        "import os, sys\n"
        "me = str(os.getpid())\n"
        "for p in os.listdir('/proc'):\n"
        "    if p.isdigit() and p != me:\n"
        "        try:\n"
        "            cmd = open('/proc/%s/cmdline' % p, 'rb').read()\n"
        "        except OSError:\n"
        "            continue\n"
        "        print(p, cmd.replace(b'\\0', b' ').decode())\n",
        args=[m],
    )
    assert m not in b.stdout_text, b.stdout_text
    others = [line for line in b.stdout_text.splitlines() if not line.startswith("1 ")]
    assert not others, f"processes besides PID 1 seen by the next call: {others}"
    assert not gone_on_host(m), "outlived its call on the host"


IPC_CREATE = """
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
key = int(sys.argv[1])
flags = 0o1000 | 0o666  # IPC_CREAT
out = {'shm': libc.shmget(key, 4096, flags)}
libc.shmat.restype = ctypes.c_void_p
addr = libc.shmat(out['shm'], None, 0)
ctypes.memmove(addr, b'secret', 6)
out['sem'] = libc.semget(key, 1, flags)
out['msg'] = libc.msgget(key, flags)
out['mq'] = libc.mq_open(b'/sf%d' % key, os.O_CREAT | os.O_RDWR, 0o666, None)
print(json.dumps(out))
"""

IPC_LOOK = """
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
key = int(sys.argv[1])
out = {'shm': libc.shmget(key, 0, 0), 'sem': libc.semget(key, 0, 0), 'msg': libc.msgget(key, 0)}
out['mq'] = libc.mq_open(b'/sf%d' % key, os.O_RDWR)
if out['shm'] >= 0:
    libc.shmat.restype = ctypes.c_void_p
    addr = libc.shmat(out['shm'], None, 0)
    out['shm-data'] = ctypes.string_at(addr, 6).decode() if addr not in (None, 2**64 - 1) else ''
for kind in ('shm', 'sem', 'msg'):
    out['proc-' + kind] = open('/proc/sysvipc/' + kind).read().splitlines()[1:]
print(json.dumps(out))
"""


def test_ipc_objects_of_a_call_are_gone_in_the_next(client: Client) -> None:
    """SysV shared memory, semaphores, message queues and POSIX queues of A are gone for B."""
    key = 0x5F000000 + secrets.randbelow(1 << 20)
    a = run_ok(client, IPC_CREATE, args=[str(key)])
    made = json.loads(a.stdout)
    assert made["shm"] >= 0, f"A could not create a shared memory segment: {made}"
    b = run_ok(client, IPC_LOOK, args=[str(key)])
    seen = json.loads(b.stdout)
    workers = f"A ran in {a.worker}, B in {b.worker}"
    assert "shm-data" not in seen, f"B read A's shared memory: {seen['shm-data']!r}; {workers}"
    for kind in ("shm", "sem", "msg", "mq"):
        if made[kind] >= 0:  # a kind A could not create (seccomp) cannot leak
            assert seen[kind] == -1, f"{kind} of A seen by B: {made} -> {seen}; {workers}"
    assert (seen["proc-shm"], seen["proc-sem"], seen["proc-msg"]) == ([], [], []), seen


@pytest.mark.skipif(platform.machine() != "x86_64", reason="syscall numbers of x86_64")
def test_kernel_keyrings_do_not_carry_data_between_calls(client: Client) -> None:
    """A key A adds to its user keyring (shared by every process of uid nobody) is not in B."""
    name = f"sf-leak-{secrets.token_hex(4)}".encode()
    add = (
        "import ctypes, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "r = libc.syscall(248, b'user', sys.argv[1].encode(), b'secret', 6, -4)\n"  # add_key
        "print(r, ctypes.get_errno())\n"
    )
    search = (
        "import ctypes, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "r = libc.syscall(250, 10, -4, b'user', sys.argv[1].encode(), 0)\n"  # KEYCTL_SEARCH
        "print(r, ctypes.get_errno())\n"
    )
    a = run_ok(client, add, args=[name.decode()])
    b = run_ok(client, search, args=[name.decode()])
    assert b.stdout.split()[0] == b"-1", f"A added key {a.stdout!r}; B found it: {b.stdout!r}"


def test_random_differs_between_calls(client: Client) -> None:
    """random, uuid4 and tempfile names differ in every call (the fork reseeds them)."""
    code = (
        "import random, tempfile, uuid\n"
        "print(random.getrandbits(64), random.random(), uuid.uuid4(),"
        " next(tempfile._get_candidate_names()))"
    )
    outs = [run_ok(client, code).stdout for _ in range(4)]
    assert len(set(outs)) == 4, outs
    for i in range(4):
        assert len({o.split()[i] for o in outs}) == 4, (i, outs)


# --------------------------------------------------------------------------- the call's powers


def test_calls_run_as_nobody_without_capabilities(client: Client) -> None:
    """uid/gid 65534 (python, bash, C), no supplementary groups, no capabilities, seccomp on."""
    r = run_ok(
        client,
        "import json, os\n"
        "status = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines()"
        " if ':\\t' in l)\n"
        "print(json.dumps({'res': os.getresuid(), 'resg': os.getresgid(),"
        " 'groups': os.getgroups(),"
        " 'caps': [status[k].strip() for k in ('CapInh', 'CapPrm', 'CapEff', 'CapAmb')],"
        " 'nnp': status['NoNewPrivs'].strip(), 'seccomp': status['Seccomp'].strip()}))",
    )
    got = json.loads(r.stdout)
    assert got["res"] == [NOBODY] * 3 and got["resg"] == [NOBODY] * 3, got
    assert set(got["groups"]) <= {NOBODY}, got
    assert got["caps"] == ["0000000000000000"] * 4, got
    assert (got["nnp"], got["seccomp"]) == ("1", "2"), got
    r = client.run("id -u; id -g; id -G", language="bash")
    assert r.stdout == b"65534\n65534\n65534\n", r
    r = client.run(
        '#include <stdio.h>\n#include <unistd.h>\nint main(void){ printf("%d %d", getuid(),'
        " geteuid()); return 0; }",
        language="c",
    )
    assert r.stdout == b"65534 65534", r


def test_a_call_cannot_see_or_signal_pid_1(client: Client) -> None:
    """PID 1's environ, fds, memory are closed to a call; kill(1) fails or does nothing."""
    code = (
        "import ctypes, json, os\n"
        "out = {}\n"
        "for what, fn in [\n"
        "    ('environ', lambda: open('/proc/1/environ', 'rb').read()),\n"
        "    ('fd', lambda: os.listdir('/proc/1/fd')),\n"
        "    ('mem', lambda: open('/proc/1/mem', 'rb').read(1)),\n"
        "    ('root', lambda: os.listdir('/proc/1/root/')),\n"
        "    ('kill0', lambda: os.kill(1, 0)),\n"
        "    ('term', lambda: os.kill(1, 15)),\n"
        "    ('kill9', lambda: os.kill(1, 9)),\n"
        "    ('ppid9', lambda: os.kill(os.getppid(), 9)),\n"
        "]:\n"
        "    try:\n"
        "        fn()\n"
        "        out[what] = 'done'\n"
        "    except OSError as e:\n"
        "        out[what] = 'refused %d' % e.errno\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "out['ptrace'] = libc.ptrace(16, 1, None, None)\n"  # PTRACE_ATTACH
        "print(json.dumps(out))\n"
    )
    a = run_ok(client, code)
    out = json.loads(a.stdout)
    for what in ("environ", "fd", "mem", "root"):
        assert out[what].startswith("refused"), out
    assert out["ptrace"] == -1, out
    b = run_ok(client, "print('alive')")
    assert b.stdout == b"alive\n"
    # killing PID 1 had no effect: the same worker served the next call
    assert b.worker == a.worker, (a.worker, b.worker)


@pytest.mark.parametrize(
    ("language", "code"),
    [
        (
            "python",
            "import os, subprocess\nsubprocess.Popen(['sleep', '100'])\nos.kill(-1, 9)\n"
            "print('survived')",
        ),
        ("bash", "sleep 100 & sleep 100 & kill -9 -1; wait; echo survived"),
    ],
)
def test_kill_minus_one_kills_the_rest_and_the_call_goes_on(
    client: Client, language: str, code: str
) -> None:
    """kill(-1, SIGKILL) (every process the call may signal but itself): a result, no oom."""
    r = client.run(code, language=language, timeout_s=10)
    assert (r.status, r.exit_code, r.stdout) == ("exited", 0, b"survived\n"), r
    assert run_ok(client, "print('next')").stdout == b"next\n"


def test_calls_in_other_workers_are_invisible(client: Client) -> None:
    """A concurrent call in another worker (bash pool): its processes and /tmp are not seen."""
    m = sleep_marker()
    done: dict[str, RunResult] = {}

    def other() -> None:
        done["r"] = client.run(
            f"echo secret > /tmp/other.txt; exec sleep {m}", language="bash", timeout_s=3
        )

    thread = threading.Thread(target=other)
    thread.start()
    deadline = time.monotonic() + 5
    while not host_processes(m) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host_processes(m), "the other call did not start"
    r = run_ok(
        client,
        "import os, sys\n"
        "seen = [p for p in os.listdir('/proc') if p.isdigit() and"
        " sys.argv[1].encode() in open('/proc/%s/cmdline' % p, 'rb').read()]\n"
        "print(seen, os.listdir('/tmp'))",
        args=[m],
    )
    assert r.stdout == b"[] []\n", r
    thread.join(10)
    assert done["r"].status == "timeout", done["r"]


# --------------------------------------------------------------------------- crashes


def _zygote_of(pid: int) -> int:
    """Host pid of the PID 1 of the namespace ``pid`` lives in (walking up its parents)."""
    while pid > 1:
        status = Path(f"/proc/{pid}/status").read_text()
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if fields["NSpid"].split()[-1] == "1":
            return pid
        pid = int(fields["PPid"])
    raise AssertionError("no PID 1 of a namespace above the call")


def test_a_worker_that_dies_mid_call_gives_a_status_and_is_replaced(client: Client) -> None:
    """The worker's PID 1 killed during a call: a prompt error/status, a new worker, no leak."""
    before = pool(client)
    m = sleep_marker()
    done: dict[str, Any] = {}

    def call() -> None:
        t0 = time.monotonic()
        try:
            done["r"] = client.run(
                "import os, sys\nos.execvp('sleep', ['sleep', sys.argv[1]])", args=[m], timeout_s=20
            )
        except errors.SandfleetError as exc:
            done["r"] = exc
        done["t"] = time.monotonic()
        done["t0"] = t0

    thread = threading.Thread(target=call)
    thread.start()
    deadline = time.monotonic() + 5
    while not (pids := host_processes(m)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pids, "the call did not start"
    zygote = _zygote_of(pids[0])
    os.kill(zygote, signal.SIGKILL)
    killed_at = time.monotonic()
    thread.join(25)
    assert not thread.is_alive()
    r = done["r"]
    assert done["t"] - killed_at < 5, f"answered {done['t'] - killed_at:.1f}s after the crash: {r}"
    if isinstance(r, RunResult):
        assert not r.ok and r.status != "timeout", r
    else:
        assert not isinstance(r, errors.InvalidArgument | errors.NotFound), r
    assert not gone_on_host(m)
    t0 = time.monotonic()
    after = run_ok(client, "print('replaced')", timeout_s=10)
    assert after.stdout == b"replaced\n" and time.monotonic() - t0 < 10
    info = wait_pool(client, "python", lambda p: p.replaced > before.replaced)
    assert info.replaced > before.replaced, (before, info)
    assert info.busy == 0, info


def test_a_memory_exhausting_call_is_oom_and_the_pool_serves_on(client: Client) -> None:
    """A call past its memory: `oom`; the pool has no stuck worker and the next call works."""
    r = client.run("a = []\nwhile True:\n    a.append(b'x' * (1 << 20))", memory_mb=32)
    assert (r.status, r.exit_code) == ("oom", None), r
    assert run_ok(client, "print('next')", memory_mb=32).stdout == b"next\n"
    info = wait_pool(client, "python", lambda p: p.busy == 0 and p.idle >= 1)
    assert (info.busy, info.starting) == (0, 0) and info.idle >= 1, info


def test_a_call_that_kills_its_parent_gets_a_status(client: Client) -> None:
    """os.kill(os.getppid(), 9) from a call: a status comes back; the next call works."""
    t0 = time.monotonic()
    r = client.run(
        "import os, time\ntry:\n    os.kill(os.getppid(), 9)\n    print('sent')\n"
        "except OSError as e:\n    print('refused', e.errno)\ntime.sleep(0.2)\nprint('after')",
        timeout_s=10,
    )
    assert time.monotonic() - t0 < 5
    assert r.status in ("exited", "signaled"), r
    assert run_ok(client, "print('next')").stdout == b"next\n"


# --------------------------------------------------------------------------- C, C++, bash

C_ECHO = """
#include <math.h>
#include <stdio.h>
int main(int argc, char **argv) {
    char buf[64];
    size_t n = fread(buf, 1, sizeof buf, stdin);
    FILE *f = fopen("data.txt", "r");
    int x = 0;
    if (!f || fscanf(f, "%d", &x) != 1) return 9;
    FILE *o = fopen("out/result.txt", "w");
    if (!o) return 8;
    fprintf(o, "%d", x * 2);
    fclose(o);
    printf("%s %zu %.3f\\n", argc > 1 ? argv[1] : "-", n, sqrt(2.0));
    return 0;
}
"""

CPP_SORT = """
#include <algorithm>
#include <iostream>
#include <map>
#include <vector>
int main() {
    std::vector<int> v;
    int x;
    while (std::cin >> x) v.push_back(x);
    std::sort(v.begin(), v.end());
    std::map<std::string, int> m{{"a", 1}};
    for (auto [k, val] : m) std::cout << k << val << ' ';
    for (int y : v) std::cout << y;
    std::cout << std::endl;
    return 0;
}
"""


def test_c_compiles_and_runs_with_stdin_args_and_files(client: Client) -> None:
    """C: compile (gcc -O2, -lm) and run as one call, with stdin, args, files and fetch."""
    r = client.run(
        C_ECHO,
        language="c",
        stdin=b"abc",
        args=["arg1"],
        files={"data.txt": b"21", "out/.keep": b""},
        fetch_files=["out/result.txt"],
    )
    assert (r.status, r.exit_code, r.stage) == ("exited", 0, "run"), r
    assert r.stdout == b"arg1 3 1.414\n", r
    assert r.files == {"out/result.txt": b"42"}
    assert r.compile is not None and (r.compile.status, r.compile.exit_code) == ("exited", 0)
    assert r.run is not None and r.run.stdout == r.stdout


def test_cpp_compiles_and_runs(client: Client) -> None:
    """C++17: compile (g++ -O2 -std=c++17) and run as one call."""
    r = client.run(CPP_SORT, language="cpp", stdin=b"3 1 2\n")
    assert (r.status, r.exit_code, r.stage, r.stdout) == ("exited", 0, "run", b"a1 123\n"), r


@pytest.mark.parametrize(
    ("language", "code"),
    [("c", "int main( { return 0; }"), ("cpp", "int main() { undefined_thing(); }")],
)
def test_a_compile_error_stops_at_the_compile_stage(
    client: Client, language: str, code: str
) -> None:
    """A compile error: stage `compile`, run None, the compiler's exit code and message."""
    r = client.run(code, language=language)
    assert (r.stage, r.run, r.status) == ("compile", None, "exited"), r
    assert r.exit_code not in (0, None) and b"error" in r.stderr, r
    assert r.compile is not None and r.compile.exit_code == r.exit_code
    assert not r.ok


def test_compiler_warnings_stay_in_the_compile_stage(client: Client) -> None:
    """Warnings go to the compile stage's stderr; the run's stderr is the program's own."""
    r = client.run(
        '#warning "careful"\n#include <stdio.h>\nint main(void){ fputs("ran", stderr); }',
        language="c",
    )
    assert r.ok and r.stderr == b"ran", r
    assert r.compile is not None and b"careful" in r.compile.stderr


def test_a_compile_timeout_is_its_own(client: Client) -> None:
    """A compile past compile_timeout_s: stage `compile`, status `timeout`, run None, promptly."""
    # about 1 s of g++ -O2 on this machine
    code = (
        "#include <bits/stdc++.h>\nint main() { std::vector<int> v{2, 1};"
        " std::sort(v.begin(), v.end()); std::cout << v[0]; }\n"
    )
    t0 = time.monotonic()
    r = client.run(code, language="cpp", compile_timeout_s=0.2, timeout_s=30)
    elapsed = time.monotonic() - t0
    assert (r.stage, r.status, r.exit_code, r.run) == ("compile", "timeout", None, None), r
    assert r.compile is not None and r.compile.status == "timeout"
    assert elapsed < 2, elapsed
    # the same code compiles with time enough; the pool goes on
    r = client.run(code, language="cpp", compile_timeout_s=30, memory_mb=512)
    assert (r.stage, r.status, r.stdout) == ("run", "exited", b"1"), r


def test_the_run_timeout_is_separate_from_the_compile_timeout(client: Client) -> None:
    """A run past timeout_s after a good compile: stage `run`, `timeout`, compile exited 0."""
    r = client.run("#include <unistd.h>\nint main(void){ sleep(10); }", language="c", timeout_s=1)
    assert (r.stage, r.status, r.exit_code) == ("run", "timeout", None), r
    assert r.compile is not None and (r.compile.status, r.compile.exit_code) == ("exited", 0)


def test_bash_gets_its_args_and_stdin(client: Client) -> None:
    """bash: `bash -c code bash *args`, stdin given, exit code kept."""
    r = client.run(
        'printf "%s|" "$0" "$@"; read -r line; echo "<$line>"; exit 4',
        language="bash",
        args=["a", "b c"],
        stdin="in put\n",
    )
    assert (r.status, r.exit_code, r.stdout) == ("exited", 4, b"bash|a|b c|<in put>\n"), r


# --------------------------------------------------------------------------- pools


def test_pool_counters_count_calls(client: Client) -> None:
    """`calls` counts every call; after them the pool is idle, nothing queued or busy."""
    before = pool(client)
    for i in range(5):
        run_ok(client, f"print({i})")
    after = wait_pool(client, "python", lambda p: p.busy == 0)
    assert after.calls == before.calls + 5, (before, after)
    assert (after.busy, after.queued, after.rejected) == (0, 0, before.rejected), after
    assert after.idle == 1 and (after.min_workers, after.max_workers) == (1, 1), after
    assert after.node_id and after.worker_memory_mb and after.worker_memory_mb > 0, after


def test_min_workers_are_kept_warm_and_extra_ones_stop_when_idle(client: Client) -> None:
    """configure_pool(min_workers=2) starts two idle workers; min 0 with idle_s=1 stops them."""
    infos = client.configure_pool(
        image=FNCALL_IMAGE, language="cpp", min_workers=2, max_workers=2, max_queue=10, idle_s=1
    )
    assert all((i.min_workers, i.max_workers, i.max_queue) == (2, 2, 10) for i in infos), infos
    info = wait_pool(client, "cpp", lambda p: p.idle == 2)
    assert info.idle == 2, info
    client.configure_pool(
        image=FNCALL_IMAGE, language="cpp", min_workers=0, max_workers=2, max_queue=10, idle_s=1
    )
    info = wait_pool(client, "cpp", lambda p: p.idle == 0, seconds=10)
    assert (info.idle, info.busy) == (0, 0), info
    # a call still runs: a worker starts on demand
    assert client.run("int main(){return 0;}", language="cpp").ok


def test_a_full_queue_is_resource_exhausted(client: Client, fncall_dep: LocalDeployment) -> None:
    """max_workers=1, max_queue=1: of 10 concurrent slow calls 2 run, the rest are refused."""
    client.configure_pool(
        image=FNCALL_IMAGE, language="bash", min_workers=1, max_workers=1, max_queue=1, idle_s=60
    )
    try:
        wait_pool(client, "bash", lambda p: p.idle == 1 and p.busy == 0)
        before = pool(client, "bash")

        async def main() -> list[tuple[float, RunResult | BaseException]]:
            async with AsyncClient(fncall_dep.url, timeout_s=60) as ac:

                async def one() -> tuple[float, RunResult | BaseException]:
                    t0 = time.monotonic()
                    try:
                        r: RunResult | BaseException = await ac.run(
                            "sleep 1; echo done", kind="fncall", language="bash", timeout_s=10
                        )
                    except errors.SandfleetError as exc:
                        r = exc
                    return time.monotonic() - t0, r

                return await asyncio.gather(*(one() for _ in range(10)))

        results = asyncio.run(main())
        ok = [r for _, r in results if isinstance(r, RunResult)]
        refused = [(t, r) for t, r in results if isinstance(r, errors.ResourceExhausted)]
        assert len(ok) + len(refused) == 10, results
        assert 2 <= len(ok) <= 3, results
        assert all(r.stdout == b"done\n" for r in ok), ok
        for elapsed, exc in refused:
            assert "queue" in str(exc) and "full" in str(exc), str(exc)
            assert exc.retryable
            assert elapsed < 0.9, f"refused only after {elapsed:.1f}s"
        after = pool(client, "bash")
        assert after.rejected == before.rejected + len(refused), (before, after)
    finally:
        client.configure_pool(
            image=FNCALL_IMAGE,
            language="bash",
            min_workers=1,
            max_workers=8,
            max_queue=4096,
            idle_s=60,
        )


def test_sandfleet_pools_shows_the_pools(client: Client, fncall_dep: LocalDeployment) -> None:
    """`sandfleet pools --url`: one row per pool with its node, language and counters."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "sandfleet.cli", "pools", "--url", fncall_dep.url],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "250"},
    )
    assert out.returncode == 0, out.stderr
    assert fncall_dep.node_id in out.stdout and FNCALL_IMAGE in out.stdout, out.stdout
    for language in ("python", "bash", "cpp"):
        assert language in out.stdout, out.stdout


def test_a_kill_a_call_survived_is_not_blamed_on_the_next_call(client: Client) -> None:
    """A child OOM-killed while its call exits 0; the next call's failure is its own."""
    survived = client.run(
        "import subprocess, sys\n"
        "r = subprocess.run([sys.executable, '-c', 'b = bytearray(600 << 20)'])\n"
        "print(r.returncode)",
        memory_mb=128,
    )
    assert survived.status == "exited" and survived.exit_code == 0, survived
    assert survived.stdout == b"-9\n"
    after = client.run("import sys; sys.exit(4)")
    assert after.status == "exited" and after.exit_code == 4, after


def test_a_cancelled_call_stops_on_the_server(client: Client, fncall_dep: LocalDeployment) -> None:
    """Cancelling the caller stops the call: the one worker is free again at once."""

    async def main() -> float:
        async with AsyncClient(fncall_dep.url) as aclient:
            slow = asyncio.ensure_future(aclient.run("import time; time.sleep(8)", kind="fncall"))
            await asyncio.sleep(0.7)
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            started = time.monotonic()
            after = await aclient.run("print('next')", kind="fncall", timeout_s=20)
            assert after.stdout == b"next\n"
            return time.monotonic() - started

    assert asyncio.run(main()) < 5.0  # not the 7 s the slow call had left


def test_a_calls_memory_does_not_depend_on_the_calls_before(client: Client) -> None:
    """The same call gets the same room whatever the worker served before it."""
    code = "import sys; print(len(sys.stdin.buffer.read()))"
    big = b"z" * (20 << 20)
    first = client.run(code, stdin=big)
    for _ in range(3):
        client.run("x = bytearray(100 << 20); print(1)")
        again = client.run(code, stdin=big)
        assert again.status == first.status == "exited", (first, again)
        assert again.stdout == b"20971520\n"


def test_stdin_and_files_larger_than_the_calls_memory_are_refused(client: Client) -> None:
    with pytest.raises(errors.InvalidArgument, match="raise memory_mb"):
        client.run("print(1)", stdin=b"a" * (70 << 20), memory_mb=64)
    assert client.run("print(1)").stdout == b"1\n"  # the worker is fine
