"""The runc container backend against the real kernel: needs root, runc, EROFS.

Every test ends with a leak check: no sandbox directory, no mount under the
state dir other than the shared layer mounts, no loop device backed by a file
under it, no cgroup or process of a test sandbox, nothing in ``runc list`` or
the runc root.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from sandfleet.backends.base import Backend, BoxHandle, LayerSource, SandboxSpec
from sandfleet.backends.container import ContainerBackend
from sandfleet.backends.container import backend as backend_module
from sandfleet.backends.container.bundle import AGENT_CAPS, COMMAND_CAPS, DEFAULT_CAPS, oci_config
from sandfleet.backends.container.disk import loop_devices_under
from sandfleet.images import pack_erofs
from sandfleet.node.mounts import mounts_under
from sandfleet.wire.errors import Internal, InvalidArgument, NotFound, ResourceExhausted
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
_CAP_BITS = {
    "CAP_AUDIT_WRITE": 29, "CAP_KILL": 5, "CAP_NET_BIND_SERVICE": 10,
    "CAP_SETGID": 6, "CAP_SETUID": 7,
}  # fmt: skip


def _cap_mask(names: list[str]) -> int:
    return sum(1 << _CAP_BITS[n] for n in names)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def new_id() -> str:
    return f"{_PREFIX}{next(_counter)}"


def _mkfs(tree: Path, out: Path) -> LayerSource:
    """A whole EROFS image of ``tree`` (metadata and data in one file)."""
    subprocess.run(["mkfs.erofs", "--quiet", str(out), str(tree)], check=True)
    return LayerSource(meta=out)


def _split(tree: Path, out_dir: Path, name: str) -> LayerSource:
    """A split EROFS layer of ``tree``: metadata image plus data blob, as images store them."""
    blob = out_dir / f"{name}.blob"
    meta = pack_erofs(tree, out_dir / f"{name}.erofs", blob_file=blob)
    digest = hashlib.sha256(meta.read_bytes() + blob.read_bytes()).hexdigest()
    return LayerSource(meta=meta, data=blob, digest=f"sha256:{digest}")


@pytest.fixture(scope="session")
def busybox_layer(tmp_path_factory: pytest.TempPathFactory) -> LayerSource:
    """A split EROFS layer with /bin/busybox and its applets as relative symlinks."""
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
    (tree / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n"
    )
    (tree / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (tree / "tmp").chmod(0o1777)
    return _split(tree, tmp_path_factory.mktemp("layers"), "busybox")


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
    assert loop_devices_under(state) == []
    assert list(backend.runc_root.iterdir()) == []
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


def spec(layer: LayerSource, **kw: Any) -> SandboxSpec:
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
    assert cfg["process"]["args"] == [
        "/.sandfleet/agent",
        "--listen-fd",
        "3",
        "--run-dir",
        "/.sandfleet/run",
    ]
    assert "A=1" in cfg["process"]["env"]
    caps = cfg["process"]["capabilities"]
    for key in ("bounding", "effective", "permitted"):
        assert sorted(caps[key]) == sorted(AGENT_CAPS)
    assert set(AGENT_CAPS) - set(DEFAULT_CAPS) == {"CAP_SETUID", "CAP_SETGID"}
    assert (
        caps["inheritable"] == []
        and caps["ambient"] == []
        and cfg["process"]["noNewPrivileges"] is True
    )
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


def test_create_exec_destroy(backend: ContainerBackend, busybox_layer: LayerSource) -> None:
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
    backend: ContainerBackend, busybox_layer: LayerSource
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


def test_whole_and_split_layers_stack(
    backend: ContainerBackend, busybox_layer: LayerSource, tmp_path: Path
) -> None:
    whole_tree, split_tree = tmp_path / "whole", tmp_path / "split"
    for tree in (whole_tree, split_tree):
        (tree / "etc").mkdir(parents=True)
    (whole_tree / "etc" / "both").write_text("whole\n")
    (whole_tree / "etc" / "whole-only").write_text("from the whole image\n")
    big = os.urandom(300_000)
    (split_tree / "etc" / "both").write_text("split\n")
    (split_tree / "etc" / "big").write_bytes(big)
    whole = _mkfs(whole_tree, tmp_path / "whole.erofs")
    top = _split(split_tree, tmp_path, "top")

    async def body() -> None:
        h = await backend.create(spec(busybox_layer, layers=[busybox_layer, whole, top]))
        r = await sh(h, "cat /etc/both /etc/whole-only; md5sum /etc/big; readlink /bin/sh")
        assert r.ok, r.stderr
        assert r.stdout.decode().split("\n") == [
            "split", "from the whole image", f"{hashlib.md5(big).hexdigest()}  /etc/big",
            "busybox", "",
        ]  # fmt: skip
        record = json.loads((backend.state_dir / "sandboxes" / h.id / "sandbox.json").read_text())
        assert record["digests"] == [busybox_layer.digest, "", top.digest]
        await backend.destroy(h.id)

    run(body())


def test_layers_differing_only_in_data_get_their_own_mounts(
    backend: ContainerBackend, busybox_layer: LayerSource, tmp_path: Path
) -> None:
    tops = []
    for name in ("a", "b"):
        tree = tmp_path / name
        (tree / "etc").mkdir(parents=True)
        (tree / "etc" / "which").write_text(name * 4 + "\n")
        tops.append(_split(tree, tmp_path, name))
    # Same names and sizes: the same metadata image, over different data.
    assert tops[0].meta.read_bytes() == tops[1].meta.read_bytes()

    async def body() -> None:
        boxes = [await backend.create(spec(busybox_layer, layers=[busybox_layer, t])) for t in tops]
        for h, name in zip(boxes, ("a", "b"), strict=True):
            r = await sh(h, "cat /etc/which")
            assert r.stdout == (name * 4 + "\n").encode(), r
        assert sorted(backend.layers.mounted().values()) == [1, 1, 2]
        for h in boxes:
            await backend.destroy(h.id)

    run(body())


# ---------------------------------------------------------------------- containment


def test_network_is_loopback_only_and_up(
    backend: ContainerBackend, busybox_layer: LayerSource
) -> None:
    async def body() -> None:
        h = await backend.create(spec(busybox_layer))
        r = await sh(h, "ip -o link")
        lines = r.stdout.decode().splitlines()
        assert len(lines) == 1 and ": lo: " in lines[0] and ",UP" in lines[0], lines
        r = await sh(h, "tail -n +3 /proc/net/dev")
        assert [ln.split(":")[0].strip() for ln in r.stdout.decode().splitlines()] == ["lo"]
        await backend.destroy(h.id)

    run(body())


def test_proc_masked_and_caps(backend: ContainerBackend, busybox_layer: LayerSource) -> None:
    async def body() -> None:
        h = await backend.create(spec(busybox_layer))
        # masked: /dev/null over files (or absent, as /proc/kcore on some kernels)
        for path in ("/proc/kcore", "/proc/timer_list", "/proc/keys"):
            r = await sh(h, f"cat {path} 2>/dev/null | wc -c")
            assert r.stdout.strip() == b"0", path
        r = await sh(h, "ls /sys/firmware | wc -l; echo 1 > /proc/sysrq-trigger")
        assert r.stdout.strip() == b"0" and r.exit_code != 0
        # commands get runc's default set minus CAP_KILL; the agent (PID 1) holds
        # that and CAP_SETUID/SETGID
        r = await sh(h, "grep -E '^Cap(Eff|Prm|Inh)' /proc/self/status")
        got = dict(ln.split(":\t") for ln in r.stdout.decode().splitlines())
        assert int(got["CapEff"], 16) == _cap_mask(COMMAND_CAPS), got
        assert int(got["CapPrm"], 16) == _cap_mask(COMMAND_CAPS), got
        assert int(got["CapInh"], 16) == 0
        r = await sh(h, "grep -E '^CapEff' /proc/1/status")
        assert int(r.stdout.split()[1], 16) == _cap_mask(AGENT_CAPS)
        r = await sh(h, "grep -E 'NoNewPrivs|Seccomp:' /proc/self/status")
        assert b"NoNewPrivs:\t1" in r.stdout and b"Seccomp:\t2" in r.stdout
        # seccomp: unshare(CLONE_NEWUSER) refused; the 32-bit personality allowed
        r = await sh(h, "unshare -U true")
        assert r.exit_code != 0 and b"not permitted" in r.stderr
        r = await sh(h, "linux32 uname -m")
        assert r.ok and r.stdout.strip() in (b"i686", b"i386"), r.stderr
        await backend.destroy(h.id)

    run(body())


def test_memory_limit_oom_kill(backend: ContainerBackend, busybox_layer: LayerSource) -> None:
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


def test_pids_limit_stops_fork_bomb(backend: ContainerBackend, busybox_layer: LayerSource) -> None:
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


def test_invalid_limits(backend: ContainerBackend, busybox_layer: LayerSource) -> None:
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
            await backend.create(spec(LayerSource(meta=Path("/nonexistent/layer.erofs"))))
        missing_blob = LayerSource(meta=busybox_layer.meta, data=Path("/nonexistent/layer.blob"))
        with pytest.raises(NotFound, match="data blob"):
            await backend.create(spec(missing_blob))
        assert set(backend.layers.mounted().values()) <= {0}

    run(body())


def test_corrupt_layer_leaves_nothing(
    backend: ContainerBackend, busybox_layer: LayerSource, tmp_path: Path
) -> None:
    bad = LayerSource(meta=tmp_path / "corrupt.erofs")
    bad.meta.write_bytes(os.urandom(1 << 20))

    async def body() -> None:
        with pytest.raises(Internal, match="EROFS"):
            await backend.create(spec(busybox_layer, layers=[busybox_layer, bad]))
        assert list(backend.layers.mounted().values()) == [0]

    run(body())


def test_runc_error_leaves_nothing(
    backend: ContainerBackend, busybox_layer: LayerSource, tmp_path: Path
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


def test_agent_exiting_at_once_leaves_nothing(tmp_path: Path, busybox_layer: LayerSource) -> None:
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


def test_destroy_after_container_died(
    backend: ContainerBackend, busybox_layer: LayerSource
) -> None:
    async def body() -> None:
        h = await backend.create(spec(busybox_layer))
        assert h.pid is not None
        os.kill(h.pid, 9)
        await asyncio.sleep(0.1)
        await backend.destroy(h.id)

    run(body())


# ---------------------------------------------------------------------- restart


def test_recover_adopts_running_and_removes_dead(
    tmp_path: Path, agent: Path, busybox_layer: LayerSource
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


# ---------------------------------------------------------------------- users


def test_command_as_another_user(backend: ContainerBackend, busybox_layer: LayerSource) -> None:
    from sandfleet.guest.client import AgentClient

    async def body() -> None:
        h = await backend.create(spec(busybox_layer))
        req = ExecRequest(cmd="id -u; id -g; grep CapEff /proc/self/status", user="nobody")
        r = await AgentClient(h.agent_socket).exec(req)
        assert r.ok, r.stderr
        uid, gid, capeff = r.stdout.decode().splitlines()
        assert (uid, gid) == ("65534", "65534")
        assert int(capeff.split()[1], 16) == 0
        await backend.destroy(h.id)

    run(body())


# ---------------------------------------------------------------------- limits


def test_disk_limit_gives_enospc(backend: ContainerBackend, busybox_layer: LayerSource) -> None:
    async def body() -> None:
        h = await backend.create(spec(busybox_layer, disk_mb=32))
        n = await backend.create(spec(busybox_layer, disk_mb=256))
        assert len(loop_devices_under(backend.state_dir)) == 2
        r = await sh(h, "dd if=/dev/zero of=/root/big bs=1M count=100", 30)
        assert r.exit_code != 0
        assert b"No space left on device" in r.stderr, r.stderr
        r = await sh(h, "df -k / | tail -1")
        assert int(r.stdout.split()[1]) <= 32 * 1024, r.stdout  # the box sees its own size
        # the box still works: a command runs, and a file written to its
        # writable layer executes (the disk is nosuid/nodev, not noexec)
        r = await sh(h, "rm /root/big && printf '#!/bin/sh\\necho hi\\n' > /tmp/x "
                        "&& chmod +x /tmp/x && /tmp/x")  # fmt: skip
        assert r.ok and r.stdout == b"hi\n", r.stderr
        # inodes are limited too: the node's inode table is not the box's to fill
        r = await sh(h, "cd /tmp && i=0; while touch f$i 2>/dev/null; do i=$((i+1)); done; "
                        "echo $i", 60)  # fmt: skip
        assert 1000 < int(r.stdout) < 10_000, r.stdout
        r = await sh(h, "echo ok")
        assert r.ok and r.stdout == b"ok\n"
        # the neighbour writes more than the full box's limit
        r = await sh(n, "dd if=/dev/zero of=/root/big bs=1M count=64 && echo ok", 30)
        assert r.ok, r.stderr
        # the host paid at most the limit for the full box (a sparse image)
        img = backend.state_dir / "sandboxes" / h.id / "disk.img"
        assert 0 < img.stat().st_blocks * 512 <= 33 << 20
        await backend.destroy(h.id)
        await backend.destroy(n.id)
        # freed: the images are unlinked and no loop device holds their inodes
        assert not img.exists()
        assert loop_devices_under(backend.state_dir) == []

    run(body())


def test_disk_limit_range(backend: ContainerBackend, busybox_layer: LayerSource) -> None:
    async def body() -> None:
        lo, hi = backend.capabilities()["disk_mb_range"]
        for bad in (lo - 1, hi + 1):
            with pytest.raises(InvalidArgument, match="disk_mb"):
                await backend.create(spec(busybox_layer, disk_mb=bad))
        backend.min_free_mb = 1 << 40  # more than any disk has
        with pytest.raises(ResourceExhausted, match="free"):
            await backend.create(spec(busybox_layer))

    run(body())


def test_disk_images_detach_their_loop_devices(backend: ContainerBackend, tmp_path: Path) -> None:
    """Each writable layer's filesystem (copy, loop device, mount) leaves nothing once unmounted.

    Its cost per create is measured by benchmarks/bench_containers.py, not asserted here.
    """
    from sandfleet.node.mounts import umount

    backend.disks.template(4096)  # made once per size
    for i in range(5):
        bundle = tmp_path / f"b{i}"
        bundle.mkdir()
        backend.disks.make(bundle, 4096)
        assert (bundle / "disk" / "upper").is_dir()
        umount(bundle / "disk")
        (bundle / "disk.img").unlink()
    deadline = time.monotonic() + 2
    while loop_devices_under(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop_devices_under(tmp_path) == []


def _cpu_usage_s(sandbox_id: str) -> float:
    root = Path("/sys/fs/cgroup")
    for p in root.glob(f"*/sandfleet/{sandbox_id}/cpuacct.usage"):
        return int(p.read_text()) / 1e9
    for p in root.glob(f"sandfleet/{sandbox_id}/cpu.stat"):  # pure v2
        for line in p.read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
    raise AssertionError("no cpu accounting file for the box")


def test_cpu_share_is_enforced(backend: ContainerBackend, busybox_layer: LayerSource) -> None:
    async def body() -> None:
        h = await backend.create(spec(busybox_layer, cpu=0.2))
        busy = asyncio.ensure_future(sh(h, "while :; do :; done", timeout_s=3.5))
        await asyncio.sleep(0.5)
        u0, t0 = _cpu_usage_s(h.id), time.monotonic()
        await asyncio.sleep(2.0)
        share = (_cpu_usage_s(h.id) - u0) / (time.monotonic() - t0)
        r = await busy
        assert r.status == "timeout"
        assert 0.10 <= share <= 0.35, f"a cpu=0.2 box used {share:.2f} of a core"
        await backend.destroy(h.id)

    run(body())


# ---------------------------------------------------------------------- half-made boxes


def _fail_after(target: Any, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``target.name`` do its work, then raise (the most left to undo).

    ``layers.acquire`` is atomic (it either takes a reference and returns it
    or raises), so there the second call fails, before doing anything.
    """
    orig = getattr(target, name)
    if name == "acquire":
        calls = itertools.count()

        def second_fails(*a: Any, **kw: Any) -> Any:
            if next(calls):
                raise RuntimeError(f"injected after {name}")
            return orig(*a, **kw)

        monkeypatch.setattr(target, name, second_fails)
    elif asyncio.iscoroutinefunction(orig):

        async def afail(*a: Any, **kw: Any) -> Any:
            await orig(*a, **kw)
            raise RuntimeError(f"injected after {name}")

        monkeypatch.setattr(target, name, afail)
    else:

        def fail(*a: Any, **kw: Any) -> Any:
            orig(*a, **kw)
            raise RuntimeError(f"injected after {name}")

        monkeypatch.setattr(target, name, fail)


_STEPS = [
    "disk.mount", "disks.make", "layers.acquire", "_mount_rootfs", "oci_config",
    "_runc_run", "_open_pidfd", "ensure_loopback_up_async", "_wait_agent",
]  # fmt: skip


@pytest.mark.parametrize("step", _STEPS)
def test_failure_at_each_create_step_leaves_nothing(
    backend: ContainerBackend,
    busybox_layer: LayerSource,
    monkeypatch: pytest.MonkeyPatch,
    step: str,
) -> None:
    from sandfleet.backends.container import disk as disk_module

    targets: dict[str, Any] = {
        "disk": disk_module, "disks": backend.disks, "layers": backend.layers,
    }  # fmt: skip
    owner, _, name = step.rpartition(".")
    if owner:
        target = targets[owner]
    elif hasattr(backend_module, name) and not hasattr(backend, name):
        target = backend_module
    else:
        target = backend
    _fail_after(target, name, monkeypatch)

    async def body() -> None:
        with pytest.raises(Internal, match=f"injected after {name}"):
            layers = [busybox_layer] * (2 if name == "acquire" else 1)
            await backend.create(spec(busybox_layer, layers=layers))
        assert set(backend.layers.mounted().values()) <= {0}

    run(body())
    monkeypatch.undo()
    assert_no_leaks(backend)


_CHILD = r"""
import asyncio, os, signal, sys, time
from pathlib import Path
from sandfleet.backends.base import LayerSource, SandboxSpec
from sandfleet.backends.container import ContainerBackend
from sandfleet.backends.container import backend as bm

state, agent, meta, data, digest, sid, step = sys.argv[1:]
be = ContainerBackend(Path(state), Path(agent))

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def after(target, name, delay=0.0):
    orig = getattr(target, name)
    if asyncio.iscoroutinefunction(orig):
        async def f(*a, **kw):
            r = await orig(*a, **kw)
            time.sleep(delay)
            die()
        setattr(target, name, f)
    else:
        def f(*a, **kw):
            r = orig(*a, **kw)
            time.sleep(delay)
            die()
        setattr(target, name, f)

if step == "disk":
    after(be.disks, "make")
elif step == "rootfs":
    after(be, "_mount_rootfs")
elif step.startswith("spawn"):  # runc run is running when the node agent dies
    after(os, "posix_spawnp", float(step[5:] or 0) / 1000)
elif step == "runc":
    after(be, "_runc_run")
elif step == "agent":
    after(be, "_wait_agent")
layer = LayerSource(meta=Path(meta), data=Path(data), digest=digest)
spec = SandboxSpec(id=sid, kind="container", layers=[layer], cpu=1.0,
                   memory_mb=128, pids_limit=64, disk_mb=64)
asyncio.run(be.create(spec))
print("created", flush=True)
die()
"""


@pytest.mark.parametrize("step", ["disk", "rootfs", "spawn", "spawn20", "runc", "agent", "done"])
def test_node_killed_mid_create_then_recover_cleans(
    tmp_path: Path, agent: Path, busybox_layer: LayerSource, step: str
) -> None:
    state = tmp_path / "state"
    sid = new_id()
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(state), str(agent), str(busybox_layer.meta),
         str(busybox_layer.data), busybox_layer.digest, sid, step],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert (state / "sandboxes" / sid).is_dir(), "the child died before it began"
    be = ContainerBackend(state, agent)

    async def body() -> None:
        handles = await be.recover()
        if step == "done":  # create had returned: the box is adopted and works
            assert [h.id for h in handles] == [sid]
            r = await sh(handles[0], "echo ok")
            assert r.ok
            await be.destroy(sid)
        else:
            assert handles == []

    try:
        run(body())
        assert_no_leaks(be)
    finally:
        for d in (state / "sandboxes").iterdir():
            run(be.destroy(d.name))
        run(be.close())
    assert mounts_under(state) == []


def test_recover_sweeps_this_nodes_stray_cgroups(tmp_path: Path, agent: Path) -> None:
    be = ContainerBackend(tmp_path / "state", agent, node_id="ctnode")
    ours = f"sb-{os.getpid():012x}-ctnode"
    other = f"sb-{os.getpid():012x}-ctnodeb"
    made = []
    for name in (ours, other):
        for d in be.cgroups.dirs(f"/sandfleet/{name}"):
            with contextlib.suppress(OSError):  # some named hierarchies refuse mkdir
                d.mkdir(parents=True)
                made.append(d)
    assert any(d.name == ours for d in made)
    try:
        run(be.recover())
        assert not any(d.exists() for d in be.cgroups.dirs(f"/sandfleet/{ours}"))
        assert any(d.exists() for d in be.cgroups.dirs(f"/sandfleet/{other}"))
    finally:
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
        run(be.close())
