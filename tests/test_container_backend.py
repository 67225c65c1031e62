"""The runc container backend against the real kernel: needs root, runc, EROFS.

Every test ends with a leak check: no sandbox directory, no mount under the
state dir other than the shared layer mounts, no cgroup or process of a test
sandbox, nothing in ``runc list``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import subprocess
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from sandfleet.backends.base import Backend, BoxHandle, SandboxSpec
from sandfleet.backends.container import ContainerBackend
from sandfleet.backends.container.bundle import DEFAULT_CAPS, oci_config
from sandfleet.node.mounts import mounts_under
from sandfleet.wire.errors import Internal, InvalidArgument, NotFound
from sandfleet.wire.models import ExecRequest, ExecResult

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(shutil.which("runc") is None, reason="needs runc"),
    pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils"),
]

T = TypeVar("T")
_PREFIX = f"ct{os.getpid()}x"
_counter = itertools.count()
_CAP_BITS = {"CAP_AUDIT_WRITE": 29, "CAP_KILL": 5, "CAP_NET_BIND_SERVICE": 10}


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def new_id() -> str:
    return f"{_PREFIX}{next(_counter)}"


def _mkfs(tree: Path, out: Path) -> Path:
    subprocess.run(["mkfs.erofs", "--quiet", str(out), str(tree)], check=True)
    return out


@pytest.fixture(scope="session")
def busybox_layer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An EROFS layer with /bin/busybox and its applets as relative symlinks."""
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("needs busybox-static")
    tree = tmp_path_factory.mktemp("bbtree")
    for d in ("bin", "tmp", "root", "etc", "proc", "sys", "dev"):
        (tree / d).mkdir()
    shutil.copy(busybox, tree / "bin" / "busybox")
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True)
    for applet in applets.stdout.split():
        if applet != "busybox":
            (tree / "bin" / applet).symlink_to("busybox")
    (tree / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    return _mkfs(tree, tmp_path_factory.mktemp("layers") / "busybox.erofs")


@pytest.fixture(scope="session")
def agent() -> Path:
    from sandfleet.guest.build import agent_binary

    return agent_binary()


def _cgroup_leftovers(prefix: str) -> list[str]:
    root = Path("/sys/fs/cgroup")
    found = [str(p) for p in root.glob(f"*/sandfleet/{prefix}*")]
    found += [str(p) for p in root.glob(f"sandfleet/{prefix}*")]  # pure v2
    return found


def _process_leftovers(prefix: str) -> list[int]:
    """Live processes in a test sandbox's cgroup.

    Zombies are not counted: a killed box's PID 1 is reparented to the node's
    PID 1, which reaps it on its own schedule (up to ~2 s on these machines).
    """
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"/sandfleet/{prefix}" not in (d / "cgroup").read_text():
                    continue
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                pids.append(int(d.name))
    return pids


def assert_no_leaks(backend: ContainerBackend) -> None:
    state = backend.state_dir
    assert list((state / "sandboxes").iterdir()) == []
    layer_root = str(state / "layers") + "/"
    stray = [
        m for m in mounts_under(state)
        if not (m.startswith(layer_root) and "/" not in m[len(layer_root):])
    ]  # fmt: skip
    assert stray == [], f"mounts left: {stray}"
    assert _cgroup_leftovers(_PREFIX) == []
    assert _process_leftovers(_PREFIX) == []
    out = subprocess.run(
        ["runc", "--root", str(backend.runc_root), "list", "-q"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert out.strip() == ""


@pytest.fixture
def backend(tmp_path: Path, agent: Path) -> Iterator[ContainerBackend]:
    be = ContainerBackend(tmp_path / "state", agent)
    try:
        yield be
        assert_no_leaks(be)
    finally:
        for d in (be.state_dir / "sandboxes").iterdir():
            run(be.destroy(d.name))
        run(be.close())
    assert mounts_under(be.state_dir) == []


def spec(layer: Path, **kw: Any) -> SandboxSpec:
    args: dict[str, Any] = {
        "id": new_id(), "kind": "container", "layers": [layer],
        "cpu": 1.0, "memory_mb": 256, "pids_limit": 256,
    }  # fmt: skip
    args.update(kw)
    return SandboxSpec(**args)


async def sh(h: BoxHandle, cmd: str | list[str], timeout_s: float = 10.0) -> ExecResult:
    from sandfleet.guest.client import AgentClient

    return await AgentClient(h.agent_socket).exec(ExecRequest(cmd=cmd, timeout_s=timeout_s))


# ---------------------------------------------------------------------- config


def test_oci_config_defaults() -> None:
    cfg = oci_config(
        sandbox_id="x", agent_host_path="/a", env={"A": "1"},
        memory_mb=64, cpu=0.5, pids_limit=100, cgroups_path="/sandfleet/x",
    )  # fmt: skip
    assert cfg["ociVersion"] == "1.0.2"
    assert cfg["process"]["args"] == ["/.sandfleet/agent", "--listen-fd", "3"]
    assert "A=1" in cfg["process"]["env"]
    caps = cfg["process"]["capabilities"]
    for key in ("bounding", "effective", "permitted"):
        assert sorted(caps[key]) == sorted(DEFAULT_CAPS)
    assert caps["ambient"] == [] and cfg["process"]["noNewPrivileges"] is True
    res = cfg["linux"]["resources"]
    assert res["memory"] == {"limit": 64 << 20, "swap": 64 << 20}
    assert res["cpu"] == {"quota": 50_000, "period": 100_000}
    assert res["pids"] == {"limit": 100}
    assert cfg["linux"]["cgroupsPath"] == "/sandfleet/x"
    types = {ns["type"] for ns in cfg["linux"]["namespaces"]}
    assert types == {"pid", "ipc", "uts", "mount", "network", "cgroup"}
    assert "/proc/kcore" in cfg["linux"]["maskedPaths"]
    assert "/proc/sys" in cfg["linux"]["readonlyPaths"]
    json.dumps(cfg)


def test_capabilities(backend: ContainerBackend) -> None:
    assert isinstance(backend, Backend)
    caps = backend.capabilities()
    assert caps["cgroup_mode"] in ("v1", "v2", "hybrid")
    assert caps["runc_version"] != "unknown"
    assert caps["overlayfs"] and caps["erofs"]


# ---------------------------------------------------------------------- lifecycle


def test_create_exec_destroy(backend: ContainerBackend, busybox_layer: Path) -> None:
    async def body() -> None:
        s = spec(busybox_layer, env={"GREETING": "hello world"})
        h = await backend.create(s)
        assert h.id == s.id
        assert h.agent_socket == backend.state_dir / "sandboxes" / s.id / "agent.sock"
        r = await sh(h, 'echo ok; echo "$GREETING"; hostname')
        assert r.ok and r.stdout == f"ok\nhello world\n{s.id}\n".encode()
        await backend.destroy(s.id)
        await backend.destroy(s.id)  # idempotent
        assert not (backend.state_dir / "sandboxes" / s.id).exists()

    run(body())


def test_two_sandboxes_share_one_layer_mount(
    backend: ContainerBackend, busybox_layer: Path
) -> None:
    async def body() -> None:
        a = await backend.create(spec(busybox_layer))
        b = await backend.create(spec(busybox_layer))
        assert list(backend.layers.mounted().values()) == [2]
        erofs = [m for m in mounts_under(backend.state_dir / "layers")]
        assert len(erofs) == 1
        # /bin/sh written in one box is unchanged in the other and in the layer
        r = await sh(a, ["/bin/busybox", "sh", "-c", "rm /bin/sh && echo hacked > /bin/sh"])
        assert r.ok, r.stderr
        r = await sh(b, ["/bin/busybox", "readlink", "/bin/sh"])
        assert r.stdout == b"busybox\n"
        assert os.readlink(Path(erofs[0]) / "bin" / "sh") == "busybox"
        await backend.destroy(a.id)
        assert list(backend.layers.mounted().values()) == [1]
        await backend.destroy(b.id)
        assert list(backend.layers.mounted().values()) == [0]  # kept as a cache

    run(body())


# ---------------------------------------------------------------------- containment


def test_network_is_loopback_only_and_up(backend: ContainerBackend, busybox_layer: Path) -> None:
    async def body() -> None:
        h = await backend.create(spec(busybox_layer))
        r = await sh(h, "ip -o link")
        lines = r.stdout.decode().splitlines()
        assert len(lines) == 1 and ": lo: " in lines[0] and ",UP" in lines[0], lines
        r = await sh(h, "tail -n +3 /proc/net/dev")
        assert [ln.split(":")[0].strip() for ln in r.stdout.decode().splitlines()] == ["lo"]
        await backend.destroy(h.id)

    run(body())


def test_proc_masked_and_caps(backend: ContainerBackend, busybox_layer: Path) -> None:
    async def body() -> None:
        h = await backend.create(spec(busybox_layer))
        # masked: /dev/null over files (or absent, as /proc/kcore on some kernels)
        for path in ("/proc/kcore", "/proc/timer_list", "/proc/keys"):
            r = await sh(h, f"cat {path} 2>/dev/null | wc -c")
            assert r.stdout.strip() == b"0", path
        r = await sh(h, "ls /sys/firmware | wc -l; echo 1 > /proc/sysrq-trigger")
        assert r.stdout.strip() == b"0" and r.exit_code != 0
        r = await sh(h, "grep CapEff /proc/self/status")
        eff = int(r.stdout.split()[1], 16)
        assert eff == sum(1 << b for b in _CAP_BITS.values())
        r = await sh(h, "grep -E 'NoNewPrivs|Seccomp:' /proc/self/status")
        assert b"NoNewPrivs:\t1" in r.stdout and b"Seccomp:\t2" in r.stdout
        # seccomp: unshare(CLONE_NEWUSER) refused; the 32-bit personality allowed
        r = await sh(h, "unshare -U true")
        assert r.exit_code != 0 and b"not permitted" in r.stderr
        r = await sh(h, "linux32 uname -m")
        assert r.ok and r.stdout.strip() in (b"i686", b"i386"), r.stderr
        await backend.destroy(h.id)

    run(body())


def test_memory_limit_oom_kill(backend: ContainerBackend, busybox_layer: Path) -> None:
    async def body() -> None:
        h = await backend.create(spec(busybox_layer, memory_mb=32))
        assert backend.oom_kills(h.id) == 0
        # dd allocates a buffer of bs bytes and fills it: 80 MiB = 2.5x the limit
        r = await sh(h, ["dd", "if=/dev/zero", "of=/dev/null", "bs=80M", "count=1"], 30)
        assert not r.ok
        assert backend.oom_kills(h.id) >= 1
        r = await sh(h, "echo ok")
        assert r.ok and r.stdout == b"ok\n"
        await backend.destroy(h.id)
        assert backend.oom_kills(h.id) == 0  # unknown once gone

    run(body())


def test_pids_limit_stops_fork_bomb(backend: ContainerBackend, busybox_layer: Path) -> None:
    async def body() -> None:
        h = await backend.create(spec(busybox_layer, pids_limit=64))
        n = await backend.create(spec(busybox_layer))
        r = await sh(h, "b() { b | b & }; b; sleep 3", timeout_s=3)
        assert r.status == "timeout" or not r.ok
        events = [
            p for p in Path("/sys/fs/cgroup").glob(f"**/sandfleet/{h.id}/pids.events")
        ]  # fmt: skip
        assert any(int(p.read_text().split()[1]) > 0 for p in events), "limit never hit"
        r = await sh(n, "echo ok")  # the neighbour is fine
        assert r.ok
        await asyncio.wait_for(backend.destroy(h.id), 10)
        await backend.destroy(n.id)

    run(body())


# ---------------------------------------------------------------------- failures


def test_invalid_limits(backend: ContainerBackend, busybox_layer: Path) -> None:
    async def body() -> None:
        for kw, word in (
            ({"memory_mb": 1}, "memory_mb"),
            ({"cpu": 0.0}, "cpu"),
            ({"cpu": 10_000.0}, "cpu"),
            ({"pids_limit": 1}, "pids_limit"),
            ({"id": "../etc"}, "id"),
        ):
            with pytest.raises(InvalidArgument, match=word):
                await backend.create(spec(busybox_layer, **kw))
        with pytest.raises(NotFound):
            await backend.create(spec(Path("/nonexistent/layer.erofs")))

    run(body())


def test_corrupt_layer_leaves_nothing(
    backend: ContainerBackend, busybox_layer: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "corrupt.erofs"
    bad.write_bytes(os.urandom(1 << 20))

    async def body() -> None:
        with pytest.raises(Internal, match="EROFS"):
            await backend.create(spec(busybox_layer, layers=[busybox_layer, bad]))
        assert list(backend.layers.mounted().values()) == [0]

    run(body())


def test_runc_error_leaves_nothing(
    backend: ContainerBackend, busybox_layer: Path, tmp_path: Path
) -> None:
    # /.sandfleet as a regular file: runc cannot create its bind-mount targets.
    tree = tmp_path / "t"
    tree.mkdir()
    (tree / ".sandfleet").write_text("in the way")
    top = _mkfs(tree, tmp_path / "top.erofs")

    async def body() -> None:
        with pytest.raises(Internal, match="runc") as info:
            await backend.create(spec(busybox_layer, layers=[busybox_layer, top]))
        assert "log tail" in str(info.value)

    run(body())


def test_agent_exiting_at_once_leaves_nothing(tmp_path: Path, busybox_layer: Path) -> None:
    # busybox run as /.sandfleet/agent finds no applet named "agent" and exits 127.
    busybox = shutil.which("busybox")
    assert busybox is not None
    be = ContainerBackend(tmp_path / "state", Path(busybox), agent_timeout_s=10)

    async def body() -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(Internal, match="applet not found"):
            await be.create(spec(busybox_layer))
        assert loop.time() - t0 < 5, "an exited agent must be noticed at once"

    try:
        run(body())
        assert_no_leaks(be)
    finally:
        run(be.close())
    assert mounts_under(be.state_dir) == []


def test_destroy_after_container_died(backend: ContainerBackend, busybox_layer: Path) -> None:
    async def body() -> None:
        h = await backend.create(spec(busybox_layer))
        assert h.pid is not None
        os.kill(h.pid, 9)
        await asyncio.sleep(0.1)
        await backend.destroy(h.id)

    run(body())


# ---------------------------------------------------------------------- restart


def test_recover_adopts_running_and_removes_dead(
    tmp_path: Path, agent: Path, busybox_layer: Path
) -> None:
    state = tmp_path / "state"
    first = ContainerBackend(state, agent)

    async def start() -> tuple[BoxHandle, BoxHandle]:
        return await first.create(spec(busybox_layer)), await first.create(spec(busybox_layer))

    alive, dead = run(start())
    assert dead.pid is not None
    os.kill(dead.pid, 9)
    run(first.close())  # the node agent "restarts": boxes keep running, layers stay mounted
    assert len(mounts_under(state / "layers")) == 1
    # an instance that never recovered must not unmount layers under live boxes
    run(ContainerBackend(state, agent).close())
    assert len(mounts_under(state / "layers")) == 1

    second = ContainerBackend(state, agent)

    async def body() -> None:
        handles = await second.recover()
        assert [h.id for h in handles] == [alive.id]
        assert list(second.layers.mounted().values()) == [1]
        r = await sh(handles[0], "echo ok")
        assert r.ok
        await second.destroy(alive.id)

    try:
        run(body())
        assert_no_leaks(second)
    finally:
        for d in (state / "sandboxes").iterdir():
            run(second.destroy(d.name))
        run(second.close())
    assert mounts_under(state) == []
