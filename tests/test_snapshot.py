"""Snapshots and forks: a sandbox's writable layer packed into a ``diff`` layer.

Real kernel throughout (EROFS, overlayfs, the cgroup freezer): what mkfs.erofs
keeps of overlayfs's whiteouts and opaque directories, sandboxes started from
a snapshot (and from a snapshot of one), forks, the errors, and a pack that
fails or is cancelled halfway leaving nothing behind.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from sandfleet.backends.base import SandboxSpec
from sandfleet.backends.container import ContainerBackend
from sandfleet.blobstore import keys as K
from sandfleet.cli.local import LocalDeployment
from sandfleet.guest.client import AgentClient
from sandfleet.images import ImageStore, build_from_directory, pack_erofs, stack_for
from sandfleet.images.snapshot import _commit, exclude_regexes, snapshot_sandbox
from sandfleet.node import mounts
from sandfleet.sdk import AsyncClient, Client
from sandfleet.wire.errors import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from sandfleet.wire.models import (
    SNAPSHOT_EXCLUDE,
    ExecRequest,
    ImageConfig,
    ImageManifest,
    NodeCreateRequest,
    SnapshotRequest,
)
from tests.conftest import _busybox_tree, assert_clean
from tests.layers import layer_source, mount_split, store_keys

T = TypeVar("T")
IMAGE = "test/snapbase:1"


def _base_tree(root: Path) -> None:
    """busybox plus what the tests change: files and directories to delete and replace."""
    _busybox_tree(root)
    opt = root / "opt"
    for d in ("gone-dir/sub", "replaced-by-file", "recreated", "kept"):
        (opt / d).mkdir(parents=True)
    (opt / "gone-dir" / "sub" / "f").write_text("f")
    (opt / "replaced-by-file" / "inside").write_text("inside")
    (opt / "recreated" / "old").write_text("old")
    (opt / "kept" / "same").write_text("same")
    (opt / "gone-file").write_text("gone")
    (opt / "chmod-me").write_text("mode")
    (opt / "chmod-me").chmod(0o644)
    (opt / "edit-me").write_text("v1\n")


@pytest.fixture(scope="module")
def snap_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An image store of this module's own (snapshots are added to it)."""
    root = tmp_path_factory.mktemp("snapimages")
    tree = tmp_path_factory.mktemp("snaptree")
    _base_tree(tree)
    build_from_directory(ImageStore(root), IMAGE, tree, log=lambda _: None)
    return root


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory, snap_images: Path) -> Iterator[LocalDeployment]:
    """One `sandfleet up` for the module's end-to-end tests; nothing may be left after."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    state = tmp_path_factory.mktemp("snapstate")
    with LocalDeployment(state, snap_images) as d:
        yield d
    assert_clean(d.state_dir)


@pytest.fixture
def client(dep: LocalDeployment) -> Iterator[Client]:
    with Client(dep.url, timeout_s=120) as c:
        yield c
        left = [s.id for s in c.list() if s.state not in ("destroyed", "destroying")]
        assert left == [], f"sandboxes left: {left}"


def _sh(sb: Any, script: str) -> str:
    r = sb.exec(["/bin/sh", "-c", script])
    assert r.ok, (script, r)
    return str(r.stdout_text)


# --------------------------------------------------------------------------- patterns (no root)


@pytest.mark.parametrize(
    ("pattern", "matches", "misses"),
    [
        ("/tmp/*", ["tmp/x", "tmp/.hidden"], ["tmp", "var/tmp/x", "tmpx/y"]),
        ("**/__pycache__", ["__pycache__", "a/b/__pycache__"], ["a/__pycache__x", "a/b"]),
        ("/var/cache/**", ["var/cache/a", "var/cache/a/b"], ["var/cache", "var/cachex/a"]),
        ("/a/**/b", ["a/b", "a/x/b", "a/x/y/b"], ["a/xb", "b", "x/a/b"]),
        ("/f?o.[ch]", ["foo.c", "fXo.h"], ["fo.c", "foo.o", "f/o.c"]),
        ("/x[!0-9]", ["xa"], ["x1", "x/"]),
        ("/a.b+(c)", ["a.b+(c)"], ["aXb+(c)", "a.bb(c)"]),
    ],
)
def test_exclude_globs_become_anchored_regexes(
    pattern: str, matches: list[str], misses: list[str]
) -> None:
    [rx] = exclude_regexes([pattern])
    for path in matches:
        assert re.match(rx, path), (pattern, rx, path)
    for path in misses:
        assert not re.match(rx, path), (pattern, rx, path)


@pytest.mark.parametrize(
    ("pattern", "says"),
    [
        ("tmp/*", "relative"),
        ("", "empty"),
        ("/", "whole sandbox"),
        ("/a//b", "empty, '.' or '..'"),
        ("/a/../b", "empty, '.' or '..'"),
        ("/tmp/", "ends with '/'"),
        ("/a[bc", "no closing"),
        ("/a[]", "class [] is empty"),
        ("/a\0b", "NUL"),
    ],
)
def test_bad_exclude_patterns_say_what_to_change(pattern: str, says: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(says)) as info:
        exclude_regexes([pattern])
    assert "absolute path in the sandbox" in info.value.message


def test_exclude_defaults_and_limits() -> None:
    assert len(exclude_regexes(None)) == len(SNAPSHOT_EXCLUDE)
    assert exclude_regexes([]) == []
    with pytest.raises(InvalidArgument, match="not the string"):
        exclude_regexes("/tmp/*")
    with pytest.raises(InvalidArgument, match="at most 256"):
        exclude_regexes(["/a"] * 257)


def _objects(store: ImageStore) -> list[str]:
    """Every layer record, metadata image and chunk in the store, sorted."""
    return sorted(k for x in ("layers/", "metas/", "chunks/") for k in store_keys(store, x))


@pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")
def test_commit_that_loses_the_race_for_its_name_leaves_only_what_gc_removes(
    tmp_path: Path,
) -> None:
    store = ImageStore(tmp_path / "store")
    tree = tmp_path / "t"
    tree.mkdir()
    (tree / "f").write_text("base")
    base = build_from_directory(store, "b:1", tree, log=lambda _: None)
    base_objects = _objects(store)
    (tree / "f").write_text("diff")
    taken = ImageManifest(name="taken", tag="1", kind="diff", layers=base.layers)
    store.put(taken)
    with store.scratch() as scratch:
        meta, blob = scratch / "diff.erofs", scratch / "diff.blob"
        pack_erofs(tree, meta, blob_file=blob)
        with pytest.raises(AlreadyExists, match="taken:1 already exists"):
            _commit(store, "taken:1", meta, blob, base.layers, ImageConfig(), "test")
        assert not meta.exists() and not blob.exists()  # consumed all the same
    assert store.resolve("taken:1") == taken  # the winner's image is untouched
    assert list(store.tmp_dir.iterdir()) == []
    # The loser's layer stays (content-addressed, it could be another image's) until a gc.
    [diff] = [k for k in store_keys(store, "layers/") if k not in base_objects]
    garbage = sorted(set(_objects(store)) - set(base_objects))
    assert diff in garbage  # (the metadata is the base's: same names and sizes)
    assert sorted(store.prune(min_age_s=0)) == garbage
    assert _objects(store) == base_objects


# --------------------------------------------------------------------------- mkfs.erofs + overlayfs


@pytest.mark.root
@pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")
def test_mkfs_erofs_keeps_whiteouts_and_opaque_dirs_for_overlayfs(tmp_path: Path) -> None:
    """The premise of snapshots: an upper dir packed as it is works as a lower layer."""
    base, upper = tmp_path / "base", tmp_path / "upper"
    for d in ("gone", "opaque", "kept"):
        (base / d).mkdir(parents=True)
    (base / "gone" / "x").write_text("x")
    (base / "opaque" / "old").write_text("old")
    (base / "kept" / "k").write_text("k")
    (base / "file").write_text("file")
    (upper / "opaque").mkdir(parents=True)
    (upper / "opaque" / "new").write_text("new")
    os.setxattr(upper / "opaque", "trusted.overlay.opaque", b"y")
    for name in ("gone", "file"):
        os.mknod(upper / name, 0o600 | stat.S_IFCHR, os.makedev(0, 0))  # whiteouts
    layers = []
    for d in (base, upper):  # split, as snapshots pack them
        blob = tmp_path / f"{d.name}.blob"
        meta = pack_erofs(d, tmp_path / f"{d.name}.erofs", preserve_mtime=True, blob_file=blob)
        layers.append((meta, blob))
    points = []
    try:
        for meta, blob in layers:
            point = tmp_path / f"m-{meta.stem}"
            point.mkdir()
            mount_split(meta, blob, point)
            points.append(point)
        packed = points[1]
        st = os.lstat(packed / "gone")
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(0, 0)
        assert os.getxattr(packed / "opaque", "trusted.overlay.opaque") == b"y"
        merged = tmp_path / "merged"
        merged.mkdir()
        mounts.mount("overlay", merged, "overlay", 0, f"lowerdir={points[1]}:{points[0]}")
        points.append(merged)
        found = sorted(str(p.relative_to(merged)) for p in merged.rglob("*"))
        assert found == ["kept", "kept/k", "opaque", "opaque/new"]
    finally:
        for point in reversed(points):
            mounts.umount(point, mounts.MNT_DETACH)
    assert mounts.mounts_under(tmp_path) == []


# --------------------------------------------------------------------------- end to end


CHANGES = textwrap.dedent(
    """
    set -e
    mkdir -p /data/deep && echo new > /data/deep/new.txt
    echo v2 >> /opt/edit-me
    rm /opt/gone-file
    rm -r /opt/gone-dir
    rm -r /opt/replaced-by-file && echo now-a-file > /opt/replaced-by-file
    rm -r /opt/recreated && mkdir /opt/recreated && echo fresh > /opt/recreated/fresh
    chmod 600 /opt/chmod-me
    ln -s /data/deep/new.txt /data/link
    ln -s ../nowhere /data/dangling
    touch -d '2001-02-03 04:05:06' /data/deep/new.txt
    echo junk > /tmp/junk
    mkdir -p /app/__pycache__ && echo pyc > /app/__pycache__/m.pyc && echo src > /app/m.py
    mkdir -p /data/big && echo big > /data/big/blob
    """
)


@pytest.mark.root
def test_snapshot_carries_every_kind_of_change_and_leaves_out_excludes(
    client: Client, dep: LocalDeployment
) -> None:
    with client.create(image=IMAGE, env={"FOO": "bar"}, labels={"t": "snap"}) as src:
        _sh(src, CHANGES)
        ref = src.snapshot()
        assert ref == f"snapshot/{src.id}:1"
        assert _sh(src, "echo alive; cat /tmp/junk") == "alive\njunk\n"  # runs on, unchanged
        custom = src.snapshot(image="test/custom:v1", exclude=["/data/big/*", "**/deep"])
        assert custom == "test/custom:v1"
        assert src.snapshot(exclude=[]) == f"snapshot/{src.id}:2"  # numbered per sandbox
        with client.create(image=ref) as copy:
            assert _sh(copy, "cat /data/deep/new.txt /opt/edit-me /opt/replaced-by-file") == (
                "new\nv1\nv2\nnow-a-file\n"
            )
            assert _sh(copy, "ls /opt").split() == [
                "chmod-me", "edit-me", "kept", "recreated", "replaced-by-file"
            ]  # fmt: skip
            assert _sh(copy, "ls -A /opt/recreated").split() == ["fresh"]  # opaque: old is gone
            assert _sh(copy, "ls -A /tmp; ls -A /app").split() == ["m.py"]  # default excludes
            assert _sh(copy, "stat -c '%a %s' /opt/chmod-me") == "600 4\n"
            assert _sh(copy, "readlink /data/link; readlink /data/dangling").split() == [
                "/data/deep/new.txt", "../nowhere"
            ]  # fmt: skip
            assert _sh(copy, "stat -c '%Y' /data/deep/new.txt") == "981173106\n"  # mtime kept
            assert _sh(copy, 'echo "$FOO"') == "bar\n"  # the sandbox's env came along
            assert _sh(copy, "cat /data/big/blob /opt/kept/same") == "big\nsame"
            assert copy.info.image == ref and copy.info.workspace is None
        with client.create(image=custom) as copy:
            assert _sh(copy, "ls -A /data; ls -A /data/big").split() == ["big", "dangling", "link"]
        with client.create(image=f"snapshot/{src.id}:2") as copy:
            assert _sh(copy, "cat /tmp/junk /app/__pycache__/m.pyc") == "junk\npyc\n"
    manifests = {m.ref: m for m in client.images()}
    assert manifests[ref].kind == "diff"
    assert [layer.kind for layer in manifests[ref].layers] == ["base", "diff"]
    assert manifests[ref].layers[0] == manifests[IMAGE].layers[0]


@pytest.mark.root
def test_snapshot_of_a_snapshot_stacks_and_image_ls_shows_diff(
    client: Client, dep: LocalDeployment
) -> None:
    with client.create(image=IMAGE) as first:
        _sh(first, "echo one > /one; rm /opt/kept/same")
        one = first.snapshot(image="test/stack:1")
    with client.create(image=one) as second:
        _sh(second, "echo two > /two; echo more >> /one; echo back > /opt/kept/same")
        two = second.snapshot(image="test/stack:2")
    with client.create(image=two) as third:
        assert _sh(third, "cat /one /two /opt/kept/same") == "one\nmore\ntwo\nback\n"
    with client.create(image=one) as again:  # the first snapshot is unchanged
        assert _sh(again, "cat /one; ls /two /opt/kept 2>&1 || true") == (
            "one\nls: /two: No such file or directory\n/opt/kept:\n"
        )
    manifests = {m.ref: m for m in client.images()}
    assert [x.kind for x in manifests[two].layers] == ["base", "diff", "diff"]
    assert manifests[two].layers[:2] == manifests[one].layers
    out = subprocess.run(
        [sys.executable, "-m", "sandfleet.cli", "image", "ls", "--images-dir", str(dep.images_dir)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "250"},
    ).stdout
    rows = [line for line in out.splitlines() if "test/stack:2" in line]
    assert len(rows) == 1 and re.search(r"\bdiff\b", rows[0]) and re.search(r"\b3\b", rows[0])


@pytest.mark.root
def test_forks_are_independent_of_each_other_and_of_the_source(
    client: Client, dep: LocalDeployment
) -> None:
    src = client.create(
        image=IMAGE, memory_mb=96, pids_limit=64, labels={"job": "fork"}, env={"E": "1"}
    )
    try:
        _sh(src, "echo 0 > /state")
        forks = src.fork(3)
        try:
            assert len({f.id for f in forks} | {src.id}) == 4
            for i, f in enumerate(forks):
                assert (f.info.memory_mb, f.info.pids_limit, f.info.labels) == (
                    96,
                    64,
                    {"job": "fork"},
                )
                assert f.info.expires_at is not None and src.info.expires_at is not None
                assert abs(f.info.expires_at - src.info.expires_at) < 5
                assert _sh(f, "cat /state; echo $E") == "0\n1\n"
                _sh(f, f"echo {i + 1} > /state; touch /only-{i}")
            _sh(src, "echo src > /state")
            for i, f in enumerate(forks):
                assert _sh(f, "cat /state; ls / | grep only-") == f"{i + 1}\nonly-{i}\n"
            assert _sh(src, "cat /state; ls / | grep -c only- || true") == "src\n0\n"
            assert {s.id for s in client.list(labels={"job": "fork"})} == {src.id} | {
                f.id for f in forks
            }
        finally:
            for f in forks:
                f.destroy()
    finally:
        src.destroy()


@pytest.mark.root
def test_async_fork_in_parallel(dep: LocalDeployment) -> None:
    async def body() -> None:
        async with AsyncClient(dep.url, timeout_s=120) as c, await c.create(image=IMAGE) as src:
            await src.exec(["/bin/sh", "-c", "echo a > /a"])
            forks = await src.fork(2)
            try:
                outs = [await f.exec(["cat", "/a"]) for f in forks]
                assert [o.stdout for o in outs] == [b"a\n", b"a\n"]
            finally:
                await asyncio.gather(*(f.destroy() for f in forks))

    asyncio.run(body())


@pytest.mark.root
def test_errors_say_what_to_change(client: Client, dep: LocalDeployment) -> None:
    with client.create(image=IMAGE) as sb:
        with pytest.raises(InvalidArgument, match="relative"):
            sb.snapshot(exclude=["tmp/*"])
        with pytest.raises(InvalidArgument, match="list of patterns"):
            sb.snapshot(exclude="/tmp/*")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="invalid image name"):
            sb.snapshot(image="Bad Name:1")
        sb.snapshot(image="test/taken:1")
        with pytest.raises(AlreadyExists, match="test/taken:1 already exists"):
            sb.snapshot(image="test/taken:1")
        with pytest.raises(AlreadyExists, match=f"image {re.escape(IMAGE)} already exists"):
            sb.snapshot(image=IMAGE)
        with pytest.raises(InvalidArgument, match="n must be an int from 1 to 64"):
            sb.fork(0)
        ghost = client.get(sb.id)
    with pytest.raises(NotFound, match=f"sandbox {sb.id} no longer exists: it was destroyed"):
        ghost.snapshot()
    assert [m.ref for m in client.images() if m.ref.startswith("test/taken")] == ["test/taken:1"]


@pytest.mark.root
def test_fork_is_all_or_nothing(client: Client, dep: LocalDeployment) -> None:
    [node] = [n for n in client.nodes() if n.node_id == dep.node_id]
    memory_mb = node.capacity.memory_mb // 4  # the source and 2 copies fit, 64 copies do not
    with client.create(image=IMAGE, memory_mb=memory_mb) as sb:
        before = {s.id for s in client.list()}
        with pytest.raises(ResourceExhausted, match=r"fork: 6[0-9] of 64 copies could not") as e:
            sb.fork(64)
        assert "none was kept" in e.value.message and e.value.retryable
        live = {s.id for s in client.list() if s.state not in ("destroyed", "destroying")}
        assert live == before


# --------------------------------------------------------------------------- packing fails halfway


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.fixture
def box_env(tmp_path: Path, snap_images: Path) -> Iterator[tuple[ContainerBackend, ImageStore]]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    from sandfleet.guest.build import agent_binary

    store = ImageStore(tmp_path / "images")
    for objects in ("layers", "metas", "chunks"):
        shutil.copytree(snap_images / objects, store.root / objects, dirs_exist_ok=True)
    shutil.copytree(
        snap_images / "manifests" / "test" / "snapbase", store.manifests_dir / "test" / "snapbase"
    )
    backend = ContainerBackend(tmp_path / "state", agent_binary())
    try:
        yield backend, store
    finally:
        for d in (backend.state_dir / "sandboxes").iterdir():
            _run(backend.destroy(d.name))
        _run(backend.close())
        for point in mounts.mounts_under(backend.state_dir / "layers"):
            mounts.umount(point, mounts.MNT_DETACH)
    assert mounts.mounts_under(tmp_path) == []


def _fake_mkfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    fake = bin_dir / "mkfs.erofs"
    fake.write_text("#!/bin/sh\n" + script)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


async def _start(backend: ContainerBackend, store: ImageStore, sid: str) -> NodeCreateRequest:
    """Start box ``sid`` on IMAGE, its layers' blobs reassembled in a directory of its own."""
    scratch = store.root.parent / f"blobs-{sid}"
    scratch.mkdir()
    layers = [layer_source(store, x.digest, scratch) for x in stack_for(store, IMAGE)[0]]
    spec = SandboxSpec(
        id=sid, kind="container", layers=layers, cpu=1, memory_mb=64, pids_limit=64, disk_mb=64
    )
    handle = await backend.create(spec)
    r = await AgentClient(handle.agent_socket).exec(
        ExecRequest(cmd=["/bin/sh", "-c", "echo x > /x"], max_output_bytes=1024)
    )
    assert r.ok
    return NodeCreateRequest(id=sid, image=IMAGE)


def _store_state(store: ImageStore) -> dict[str, list[str]]:
    """What the store holds: each kind of object, the manifests and the scratch space."""
    state = {x: store_keys(store, f"{x}/") for x in ("layers", "metas", "chunks", "access")}
    state["manifests"] = sorted(
        str(p.relative_to(store.manifests_dir)) for p in store.manifests_dir.rglob("*.json")
    )
    state["tmp"] = sorted(p.name for p in store.tmp_dir.iterdir())
    return state


@pytest.mark.root
def test_backend_snapshot_packs_a_split_layer_and_names_the_layers_below(
    box_env: tuple[ContainerBackend, ImageStore], tmp_path: Path
) -> None:
    backend, store = box_env
    meta, blob = tmp_path / "diff.erofs", tmp_path / "diff.blob"
    script = "yes sandfleet | head -c 300000 > /opt/big; echo v2 >> /opt/edit-me; rm /opt/gone-file"

    async def body() -> list[str] | None:
        await _start(backend, store, "snapsplit1")
        r = await AgentClient(backend.handle("snapsplit1").agent_socket).exec(
            ExecRequest(cmd=["/bin/sh", "-c", script], max_output_bytes=1024)
        )
        assert r.ok, r.stderr
        return await backend.snapshot("snapsplit1", meta, blob, exclude_regexes(None))

    digests = _run(body())
    assert digests == [x.digest for x in stack_for(store, IMAGE)[0]]  # what it was started on
    assert meta.stat().st_size < 300_000 <= blob.stat().st_size  # the data went to the blob
    point = tmp_path / "diff"
    point.mkdir()
    mount_split(meta, blob, point)
    try:
        assert (point / "opt" / "big").read_bytes() == (b"sandfleet\n" * 30_000)[:300_000]
        assert (point / "opt" / "edit-me").read_text() == "v1\nv2\n"
        assert (point / "x").read_text() == "x\n"
        st = os.lstat(point / "opt" / "gone-file")
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(0, 0)  # a whiteout
        assert not (point / "opt" / "kept").exists()  # only what changed
    finally:
        mounts.umount(point, mounts.MNT_DETACH)


@pytest.mark.root
def test_pack_failing_halfway_leaves_nothing_and_the_box_runs(
    box_env: tuple[ContainerBackend, ImageStore], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, store = box_env
    seen = tmp_path / "seen"
    # Records whether the box was frozen while "packing", writes half a file, fails.
    _fake_mkfs(
        tmp_path,
        monkeypatch,
        f'cat "$SNAP_FREEZER" > {seen}\nfor last; do :; done\n'
        'out=""; prev=""; for a; do [ "$a" = "$last" ] && out="$prev"; prev="$a"; done\n'
        'head -c 100000 /dev/urandom > "$out"\necho "disk on fire" >&2\nexit 1\n',
    )
    before = _store_state(store)

    async def body() -> None:
        req = await _start(backend, store, "snapfail1")
        monkeypatch.setenv("SNAP_FREEZER", str(_freezer_file(backend, "snapfail1")))
        with pytest.raises(Internal, match="disk on fire"):
            await snapshot_sandbox(store, backend, req, ImageConfig(), SnapshotRequest())
        assert not backend.freezer.frozen("/sandfleet/snapfail1")
        r = await AgentClient(backend.handle("snapfail1").agent_socket).exec(
            ExecRequest(cmd=["cat", "/x"], max_output_bytes=1024)
        )
        assert r.stdout == b"x\n"

    _run(body())
    assert seen.read_text().strip() in ("FROZEN", "1")  # it was frozen while mkfs ran
    assert _store_state(store) == before


@pytest.mark.root
def test_cancelled_snapshot_leaves_nothing_and_thaws(
    box_env: tuple[ContainerBackend, ImageStore], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, store = box_env
    _fake_mkfs(tmp_path, monkeypatch, 'sleep 0.5\nexec /usr/bin/mkfs.erofs "$@"\n')
    before = _store_state(store)

    async def body() -> None:
        req = await _start(backend, store, "snapcancel1")
        task = asyncio.ensure_future(
            snapshot_sandbox(store, backend, req, ImageConfig(), SnapshotRequest())
        )
        await asyncio.sleep(0.2)
        assert backend.freezer.frozen("/sandfleet/snapcancel1")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not backend.freezer.frozen("/sandfleet/snapcancel1")
        # A destroy during a snapshot waits for it; a second snapshot meanwhile is refused.
        slow = asyncio.ensure_future(
            snapshot_sandbox(store, backend, req, ImageConfig(), SnapshotRequest(image="t/s:1"))
        )
        await asyncio.sleep(0.2)
        with pytest.raises(FailedPrecondition, match="retry later"):
            await snapshot_sandbox(store, backend, req, ImageConfig(), SnapshotRequest())
        await backend.destroy("snapcancel1")  # waits for the pack to end
        assert (await slow).ref == "t/s:1"

    _run(body())
    after = _store_state(store)
    assert after["tmp"] == before["tmp"] and after["access"] == before["access"]
    assert after["manifests"] == sorted([*before["manifests"], "t/s/1.json"])
    assert set(after["layers"]) >= set(before["layers"])
    [new] = set(after["layers"]) - set(before["layers"])  # one layer more: the committed one
    assert new == K.layer_key(store.resolve("t/s:1").layers[-1].digest)
    assert len(after["metas"]) == len(before["metas"]) + 1
    assert set(after["chunks"]) >= set(before["chunks"])


def _freezer_file(backend: ContainerBackend, sid: str) -> Path:
    layout = backend.cgroups
    v1 = [m for m, ctrls in layout.v1_mounts.items() if "freezer" in ctrls]
    if v1:
        return Path(v1[0]) / "sandfleet" / sid / "freezer.state"
    assert layout.v2_mount is not None
    return Path(layout.v2_mount) / "sandfleet" / sid / "cgroup.freeze"
