"""microvm and vm sandboxes through the SDK: what only VMs have.

The shared contract (exec, files, limits, isolation, restarts) is the
conformance suite, run for every kind. Here: the guest is a kernel of its own,
creates restore a template whose clock and random state are made fresh, pause
frees QEMU and resume brings files, processes and their output back, and QEMU
sits in a host cgroup with no NIC. Real QEMU (TCG here), real guest kernel.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandfleet import errors
from sandfleet.cli.local import LocalDeployment
from sandfleet.sdk import Client, Sandbox
from tests.conftest import BUSYBOX_IMAGE, assert_clean

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, images_dir: Path) -> Iterator[LocalDeployment]:
    state = tmp_path_factory.mktemp("vms") / "state"
    with LocalDeployment(state, images_dir) as dep:
        yield dep
    assert_clean(dep.state_dir)


@pytest.fixture
def client(up: LocalDeployment) -> Iterator[Client]:
    with Client(up.url) as c:
        yield c
        for info in c.list():
            c.get(info.id).destroy()


def _qemu_pids(state_dir: Path, sandbox_id: str) -> list[int]:
    """QEMU processes whose command line names this sandbox's directory."""
    found = []
    needle = f"/{sandbox_id}/pid".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _assert_clock(sb: Sandbox) -> None:
    """The guest's clock reads the host's time (whole seconds; within 1 s either side,
    however long the call took)."""
    before = time.time()
    guest = int(sb.exec("date +%s").stdout_text)
    after = time.time()
    assert int(before) - 1 <= guest <= after + 1, (sb.id, before, guest, after)


@pytest.mark.parametrize("kind", ["microvm", "vm"])
def test_the_guest_runs_its_own_kernel_without_a_nic(client: Client, kind: str) -> None:
    sb = client.create(kind=kind, image=BUSYBOX_IMAGE, memory_mb=128, cpu=2)
    uname = sb.exec("uname -r").stdout_text.strip()
    assert uname.endswith("-cloud-amd64") and uname != platform.release(), uname
    assert sb.exec("ls /sys/class/net").stdout_text.split() == ["lo"]
    assert sb.exec("nproc").stdout_text.strip() == "2"
    # memory_mb is what the sandbox's processes get: the guest's cgroup says so
    assert sb.exec("cat /sys/fs/cgroup/sandbox/memory.max").stdout_text.strip() == str(128 << 20)


def test_qemu_is_confined_to_a_host_cgroup(up: LocalDeployment, client: Client) -> None:
    sb = client.create(kind="microvm", image=BUSYBOX_IMAGE, memory_mb=64)
    pids = _qemu_pids(up.state_dir, sb.id)
    assert len(pids) == 1
    cgroups = Path(f"/proc/{pids[0]}/cgroup").read_text()
    assert f"/sandfleet-vm/{sb.id}" in cgroups, cgroups


def test_clones_of_a_template_get_the_time_and_fresh_randomness(client: Client) -> None:
    first = client.create(kind="microvm", image=BUSYBOX_IMAGE, memory_mb=96)
    time.sleep(3)  # the template's clock is now 3 s behind
    a = client.create(kind="microvm", image=BUSYBOX_IMAGE, memory_mb=96)
    b = client.create(kind="microvm", image=BUSYBOX_IMAGE, memory_mb=96)
    for sb in (first, a, b):
        _assert_clock(sb)
        assert sb.exec("hostname").stdout_text.strip() == sb.id[:63]
    rand = [sb.exec("head -c 16 /dev/urandom | od -An -tx1").stdout for sb in (a, b)]
    assert rand[0] != rand[1]
    uuids = [sb.exec("cat /proc/sys/kernel/random/uuid").stdout for sb in (a, b)]
    assert uuids[0] != uuids[1]
    # each clone has a disk of its own
    a.files.write("/root/mine", b"a")
    assert not b.exec("test -e /root/mine").ok


@pytest.mark.parametrize("kind", ["microvm", "vm"])
def test_pause_frees_qemu_and_the_next_call_resumes_everything(
    up: LocalDeployment, client: Client, kind: str
) -> None:
    sb = client.create(kind=kind, image=BUSYBOX_IMAGE, memory_mb=96)
    sb.files.write("/root/notes.txt", b"kept across pause\n")
    proc = sb.spawn("i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.2; done")
    time.sleep(1.5)
    assert len(_qemu_pids(up.state_dir, sb.id)) == 1
    sb.pause()
    assert sb.info.state == "paused"
    assert _qemu_pids(up.state_dir, sb.id) == [], "a paused VM still has its QEMU"
    box_dir = next(up.state_dir.glob(f"**/sandboxes/{sb.id}"))
    assert (box_dir / "paused.state").stat().st_size > 1 << 20
    # any call resumes it
    assert sb.files.read("/root/notes.txt") == b"kept across pause\n"
    assert len(_qemu_pids(up.state_dir, sb.id)) == 1
    before = proc.read_output().data.count(b"tick")
    assert before >= 5
    time.sleep(1.0)
    after = proc.read_output().data.count(b"tick")
    assert after > before, "the background process stopped"
    _assert_clock(sb)
    sb.pause()
    sb.destroy()
    assert not box_dir.exists()


def test_pause_with_a_call_in_flight_is_refused_and_harms_nothing(client: Client) -> None:
    sb = client.create(kind="microvm", image=BUSYBOX_IMAGE, memory_mb=96)
    import threading

    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(sb.exec("sleep 3; echo done")))
    t.start()
    time.sleep(1.0)
    with pytest.raises(errors.FailedPrecondition, match="in flight"):
        sb.pause()
    t.join()
    assert getattr(result[0], "stdout", None) == b"done\n"
    sb.pause()
    assert sb.exec("echo back").stdout == b"back\n"


def test_the_template_path_and_the_boot_path_give_the_same_sandbox(
    tmp_path: Path, images_dir: Path
) -> None:
    env = {"SANDFLEET_VM_TEMPLATES": "0"}
    with LocalDeployment(tmp_path / "state", images_dir, env=env) as dep, Client(dep.url) as c:
        sb = c.create(kind="microvm", image=BUSYBOX_IMAGE, memory_mb=64)
        assert sb.exec("echo booted; hostname").stdout_text.split() == ["booted", sb.id[:63]]
        assert not list(dep.state_dir.glob("**/microvm/templates/*"))
        sb.destroy()
    assert_clean(dep.state_dir)


def test_a_snapshot_of_a_vm_and_its_forks(client: Client) -> None:
    """The writable layer on the guest's disk packs into an image any kind can run."""
    sb = client.create(kind="microvm", image=BUSYBOX_IMAGE, memory_mb=96)
    sb.files.write("/root/state.txt", b"step 3\n")
    assert sb.exec("rm /etc/group && mkdir -p /data && echo x > /data/x").ok
    ref = sb.snapshot()
    assert sb.exec("cat /root/state.txt").stdout == b"step 3\n", "the source runs on"
    for kind in ("microvm", "container"):
        child = client.create(kind=kind, image=ref, memory_mb=96)
        assert child.files.read("/root/state.txt") == b"step 3\n"
        assert child.exec("test -e /etc/group").exit_code == 1, "a deletion is kept"
        assert child.exec("cat /data/x").stdout == b"x\n"
    forks = sb.fork(2)
    assert [f.exec("cat /root/state.txt").stdout for f in forks] == [b"step 3\n"] * 2
    sb.pause()
    paused_ref = sb.snapshot()  # read from its disk as it is; it stays paused
    assert client.get(sb.id).info.state == "paused"
    assert client.create(kind="microvm", image=paused_ref).files.read("/data/x") == b"x\n"


@pytest.mark.parametrize("kind", ["microvm", "vm"])
def test_an_unchanged_sandbox_snapshots_and_forks(client: Client, kind: str) -> None:
    """A diff layer with no file data (nothing written) still starts a VM."""
    sb = client.create(kind=kind, image=BUSYBOX_IMAGE, memory_mb=96)
    forks = sb.fork(2)
    assert [f.exec("echo forked").stdout for f in forks] == [b"forked\n"] * 2


def test_a_guest_that_cannot_boot_fails_clearly_and_leaves_nothing(
    up: LocalDeployment, client: Client, tmp_path: Path
) -> None:
    """A layer the guest cannot mount: a non-retryable error with the console's words."""
    from sandfleet.images.build import build_from_directory
    from sandfleet.images.store import ImageStore

    # An image of its own whose metadata is then zeroed: no EROFS superblock.
    store = ImageStore(up.images_dir)
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "unique").write_bytes(os.urandom(64))
    manifest = build_from_directory(store, "test/broken:1", tree)
    meta = store.meta_path(store.layer_record(manifest.layers[0].digest))
    meta.chmod(0o644)
    meta.write_bytes(bytes(meta.stat().st_size))
    with pytest.raises(errors.Internal, match="sandfleet-init: mount layer 0"):
        client.create(kind="microvm", image="test/broken:1", memory_mb=64)
    assert not list(up.state_dir.glob("**/templates/.*.tmp"))
    assert not client.list()
