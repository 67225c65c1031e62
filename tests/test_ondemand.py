"""The on-demand daemon, for real: a split EROFS layer, a FUSE mount, chunk stores on disk.

Each test builds a layer with mkfs.erofs --blobdev, cuts its blob into a
``file://`` "remote" store, starts the daemon through :class:`OnDemand` and
mounts the layer's metadata image with ``device=<blob file on the FUSE mount>``.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandfleet.blobstore import FileBlobStore, LayerRecord, ObjectRef
from sandfleet.blobstore.keys import chunk_key, layer_key, meta_key, sha256_digest
from sandfleet.errors import DeadlineExceeded, FailedPrecondition
from sandfleet.node import mounts
from sandfleet.ondemand import ChunkCache, Fetcher, Layer, OnDemand, OnDemandConfig

pytestmark = pytest.mark.root

#: Chunk size of the test layers: small, so a few MiB make a few dozen chunks.
CHUNK = 256 << 10


@dataclass
class BuiltLayer:
    """A layer in a local store (record + meta) with its chunks in a remote store."""

    digest: str
    record: LayerRecord
    tree: Path
    local: Path
    remote: Path
    blob: bytes

    @property
    def meta_path(self) -> Path:
        return self.local / meta_key(self.record.meta.digest)


def make_tree(root: Path, seed: int = 7) -> None:
    """A few MiB of random files, small files, a directory and a symlink."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    for i in range(3):
        (root / f"big{i}.bin").write_bytes(rng.randbytes(1_500_000 + 333 * i))
    sub = root / "etc" / "conf.d"
    sub.mkdir(parents=True)
    for i in range(20):
        (sub / f"small{i}.txt").write_text(f"line {i}\n" * (i + 1))
    (root / "medium.dat").write_bytes(rng.randbytes(100_000))
    (root / "link").symlink_to("etc/conf.d/small3.txt")
    (root / "empty").write_bytes(b"")


def build_layer(base: Path, chunk_size: int = CHUNK) -> BuiltLayer:
    """Split-pack ``make_tree`` and store it as a sandfleet layer."""
    tree = base / "tree"
    make_tree(tree)
    meta, blob_file = base / "layer.meta", base / "layer.blob"
    subprocess.run(
        ["mkfs.erofs", "--quiet", f"--blobdev={blob_file}", "--chunksize=65536", "-T0", meta, tree],
        check=True,
    )
    blob, meta_bytes = blob_file.read_bytes(), meta.read_bytes()
    remote, local = FileBlobStore(base / "remote"), FileBlobStore(base / "local")
    chunks = []
    for off in range(0, len(blob), chunk_size):
        piece = blob[off : off + chunk_size]
        chunks.append(sha256_digest(piece))
        remote.put(chunk_key(chunks[-1]), piece)
    record = LayerRecord(
        meta=ObjectRef(digest=sha256_digest(meta_bytes), size=len(meta_bytes)),
        blob_size=len(blob),
        chunk_size=chunk_size,
        chunks=chunks,
    )
    local.put(meta_key(record.meta.digest), meta_bytes)
    local.put(layer_key(record.digest()), record.to_bytes())
    return BuiltLayer(record.digest(), record, tree, base / "local", base / "remote", blob)


@pytest.fixture
def layer(tmp_path: Path) -> BuiltLayer:
    return build_layer(tmp_path / "layer")


class Daemons:
    """Starts daemons and EROFS mounts for a test; tears everything down after it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[OnDemand] = []
        self.erofs: list[Path] = []
        self.n = 0

    def start(self, layer: BuiltLayer, cache: Path | None = None, **kw: object) -> OnDemand:
        self.n += 1
        kw.setdefault("remotes", (layer.remote.as_uri(),))
        config = OnDemandConfig(
            store_root=layer.local,
            cache_dir=cache or self.tmp / f"cache{self.n}",
            cache_bytes=kw.pop("cache_bytes", 1 << 30),  # type: ignore[arg-type]
            **kw,  # type: ignore[arg-type]
        )
        od = OnDemand(self.tmp / f"state{self.n}", config)
        self.started.append(od)
        od.start()
        return od

    def mount_layer(self, od: OnDemand, layer: BuiltLayer) -> Path:
        target = self.tmp / f"erofs{len(self.erofs)}"
        target.mkdir()
        device = od.blob_path(layer.digest)
        mounts.mount(layer.meta_path, target, "erofs", mounts.MS_RDONLY, f"device={device}")
        self.erofs.append(target)
        return target

    def umount_layers(self) -> None:
        for target in reversed(self.erofs):
            mounts.umount(target)
        self.erofs.clear()

    def cleanup(self) -> None:
        for target in self.erofs:
            mounts.umount(target, mounts.MNT_DETACH)
        for od in self.started:
            try:
                od.stop()
            except Exception:
                pid = od._recorded_pid()
                if pid is not None and od._is_daemon(pid):
                    os.kill(pid, signal.SIGKILL)
                mounts.umount(od.mount_dir, mounts.MNT_DETACH)
        left = mounts.mounts_under(self.tmp)
        assert not left, f"mounts left behind: {left}"


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Daemons]:
    d = Daemons(tmp_path)
    try:
        yield d
    finally:
        d.cleanup()


def assert_same_tree(expected: Path, got: Path) -> int:
    """Compare every entry byte for byte; returns how many files were compared."""
    n = 0
    for dirpath, dirnames, filenames in os.walk(expected):
        rel = Path(dirpath).relative_to(expected)
        assert sorted(os.listdir(got / rel)) == sorted(dirnames + filenames), rel
        for name in filenames:
            a, b = Path(dirpath) / name, got / rel / name
            if a.is_symlink():
                assert os.readlink(b) == os.readlink(a)
            else:
                assert b.read_bytes() == a.read_bytes(), f"{rel / name} differs"
                assert b.stat().st_mode == a.stat().st_mode
            n += 1
    return n


def daemon_processes(od: OnDemand) -> list[int]:
    """Pids of live daemons serving ``od``'s mount directory."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and od._is_daemon(int(p))]


def remote_chunks(od: OnDemand) -> int:
    return int(od.stats()["fetcher"]["remote_chunks"])


def test_every_file_reads_back_byte_for_byte(layer: BuiltLayer, daemons: Daemons) -> None:
    od = daemons.start(layer)
    assert od.blob_path(layer.digest).stat().st_size == layer.record.blob_size
    assert od.blob_path(layer.digest).read_bytes() == layer.blob
    root = daemons.mount_layer(od, layer)
    assert assert_same_tree(layer.tree, root) == 26
    st = od.stats()
    assert st["mounted"] and st["fetcher"]["errors"] == 0
    assert st["fetcher"]["remote_chunks"] == len(layer.record.chunks)
    daemons.umount_layers()
    od.stop()
    assert not mounts.is_mountpoint(od.mount_dir)
    assert daemon_processes(od) == []


def test_an_unknown_layer_is_enoent(layer: BuiltLayer, daemons: Daemons) -> None:
    od = daemons.start(layer)
    with pytest.raises(FileNotFoundError):
        od.blob_path("sha256:" + "0" * 64).stat()
    with pytest.raises(FileNotFoundError):
        (od.mount_dir / "not-a-layer").stat()
    with pytest.raises(OSError) as e:
        open(od.blob_path(layer.digest), "r+b")  # noqa: SIM115
    assert e.value.errno in (errno.EROFS, errno.EACCES)


def test_one_small_file_fetches_few_chunks(layer: BuiltLayer, daemons: Daemons) -> None:
    od = daemons.start(layer, readahead=0)
    root = daemons.mount_layer(od, layer)
    assert (root / "medium.dat").read_bytes() == (layer.tree / "medium.dat").read_bytes()
    fetched = remote_chunks(od)
    assert 1 <= fetched <= 2 < len(layer.record.chunks) // 4
    assert len(od.access(layer.digest)) == fetched


def test_read_ahead_follows_sequential_runs_only(layer: BuiltLayer, daemons: Daemons) -> None:
    assert len(layer.record.chunks) >= 8
    od = daemons.start(layer, readahead=3)

    def settle(count: int) -> None:
        deadline = time.monotonic() + 10
        while od.stats()["cache"]["count"] < count and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # nothing more may come
        assert od.stats()["cache"]["count"] == count

    with open(od.blob_path(layer.digest), "rb") as fh:
        # a first read alone fetches its chunk only: scattered reads are most of start-up
        assert os.pread(fh.fileno(), 4096, 0) == layer.blob[:4096]
        settle(1)
        # chunk 1 right after chunk 0: a run of 1 reads 1 ahead (chunk 2)
        assert os.pread(fh.fileno(), 4096, CHUNK) == layer.blob[CHUNK : CHUNK + 4096]
        settle(3)
        # chunk 2 ends a run of 2: 2 ahead (3, 4)
        assert os.pread(fh.fileno(), 4096, 2 * CHUNK) == layer.blob[2 * CHUNK : 2 * CHUNK + 4096]
        settle(5)
    assert od.access(layer.digest) == [0, 1, 2]  # read-ahead is not a read


def test_a_second_run_reads_from_the_cache(
    layer: BuiltLayer, daemons: Daemons, tmp_path: Path
) -> None:
    cache = tmp_path / "shared-cache"
    od = daemons.start(layer, cache=cache)
    assert od.blob_path(layer.digest).read_bytes() == layer.blob
    od.stop()
    od2 = daemons.start(layer, cache=cache)
    root = daemons.mount_layer(od2, layer)
    assert_same_tree(layer.tree, root)
    st = od2.stats()
    assert st["fetcher"]["remote_chunks"] == 0
    assert st["fetcher"]["hits_cache"] > 0
    assert st["cache"]["count"] == len(layer.record.chunks)


def test_the_cache_stays_within_its_bound(layer: BuiltLayer, daemons: Daemons) -> None:
    bound = 3 * CHUNK + 100
    od = daemons.start(layer, cache_bytes=bound, readahead=2)
    root = daemons.mount_layer(od, layer)
    assert_same_tree(layer.tree, root)
    cache = od.stats()["cache"]
    assert cache["bytes"] <= bound and cache["evictions"] > 0
    on_disk = sum(p.stat().st_size for p in (od.config.cache_dir / "sha256").iterdir())
    assert on_disk == cache["bytes"] <= bound


def test_a_corrupt_chunk_is_eio_and_an_event(layer: BuiltLayer, daemons: Daemons) -> None:
    bad = 2
    path = layer.remote / chunk_key(layer.record.chunks[bad])
    path.write_bytes(b"\0" * path.stat().st_size)
    od = daemons.start(layer, readahead=0, deadline_s=5.0)
    t0 = time.monotonic()
    with open(od.blob_path(layer.digest), "rb") as fh, pytest.raises(OSError) as e:
        os.pread(fh.fileno(), 4096, bad * CHUNK)
    assert e.value.errno == errno.EIO
    assert time.monotonic() - t0 < 5
    events, cursor = od.events(0)
    assert cursor >= 1
    assert any(ev["chunk"] == bad and "digest" in ev["message"] for ev in events)
    assert all(ev["layer"] == layer.digest for ev in events)
    assert od.events(cursor) == ([], cursor)
    # Through EROFS too: some file sits on the bad chunk.
    root = daemons.mount_layer(od, layer)
    with pytest.raises(OSError) as e:
        assert_same_tree(layer.tree, root)
    assert e.value.errno == errno.EIO


def test_an_unreachable_remote_fails_within_the_deadline(
    layer: BuiltLayer, daemons: Daemons
) -> None:
    od = daemons.start(layer, remotes=("http://127.0.0.1:1",), deadline_s=2.0, readahead=0)
    t0 = time.monotonic()
    with open(od.blob_path(layer.digest), "rb") as fh, pytest.raises(OSError) as e:
        os.pread(fh.fileno(), 4096, 0)
    elapsed = time.monotonic() - t0
    assert e.value.errno == errno.EIO
    assert 1.0 < elapsed < 5.0
    events, _ = od.events()
    assert len(events) == 1 and "http://127.0.0.1:1" in events[0]["message"]
    assert "attempts" in events[0]["message"]  # retried, one event
    # The kernel retries a failed read, and a reader moves on to the next chunk:
    # neither may wait a whole deadline again while the store stays down.
    with open(od.blob_path(layer.digest), "rb") as fh:
        for offset in (0, 0, CHUNK, 2 * CHUNK):
            t0 = time.monotonic()
            with pytest.raises(OSError):
                os.pread(fh.fileno(), 4096, offset)
            assert time.monotonic() - t0 < 1.0


def test_prefetch_fills_the_cache(layer: BuiltLayer, daemons: Daemons) -> None:
    od = daemons.start(layer, readahead=0)
    n = len(layer.record.chunks)
    assert od.prefetch(layer.digest, range(n)) == n
    deadline = time.monotonic() + 10
    while od.stats()["cache"]["count"] < n and time.monotonic() < deadline:
        time.sleep(0.02)
    st = od.stats()
    assert st["cache"]["count"] == n and st["fetcher"]["remote_chunks"] == n
    assert od.prefetch(layer.digest, range(n)) == 0  # all local now
    assert od.blob_path(layer.digest).read_bytes() == layer.blob
    st = od.stats()
    assert st["fetcher"]["remote_chunks"] == n and st["fetcher"]["hits_remote"] == 0
    assert sorted(od.access(layer.digest)) == list(range(n))  # kernel reads run in parallel


def test_the_access_list_keeps_first_read_order(layer: BuiltLayer, daemons: Daemons) -> None:
    od = daemons.start(layer, readahead=2)
    order = [5, 2, 7, 2, 0, 5]
    with open(od.blob_path(layer.digest), "rb") as fh:
        for i in order:
            assert os.pread(fh.fileno(), 4096, i * CHUNK) == layer.blob[i * CHUNK :][:4096]
    assert od.access(layer.digest) == [5, 2, 7, 0]
    assert od.access("sha256:" + "1" * 64) == []


def test_stop_refuses_while_a_layer_is_mounted(layer: BuiltLayer, daemons: Daemons) -> None:
    od = daemons.start(layer)
    root = daemons.mount_layer(od, layer)
    with pytest.raises(FailedPrecondition, match="in use") as e:
        od.stop()
    assert str(root) in str(e.value)
    assert od.alive() and (root / "medium.dat").read_bytes()
    daemons.umount_layers()
    od.stop()
    assert not od.alive() and daemon_processes(od) == []


def test_adopt_reuses_a_live_daemon_and_cleans_a_killed_one(
    layer: BuiltLayer, daemons: Daemons
) -> None:
    od = daemons.start(layer)
    pid = od.stats()["pid"]
    again = OnDemand(od.state_dir, od.config)  # the node agent restarted
    assert again.adopt() is True and again.stats()["pid"] == pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while od._is_daemon(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert mounts.is_mountpoint(od.mount_dir)  # a dead mount stays behind
    third = OnDemand(od.state_dir, od.config)
    daemons.started.append(third)
    assert third.adopt() is False
    assert third.stats()["pid"] != pid
    assert third.blob_path(layer.digest).read_bytes() == layer.blob
    info = Path("/proc/self/mountinfo").read_text().splitlines()
    assert sum(f" {od.mount_dir} " in line for line in info) == 1


def run_daemon(tmp: Path, mount: Path, *wrapper: str) -> subprocess.CompletedProcess[str]:
    args = ["--mount", str(mount), "--store", str(tmp), "--cache", str(tmp / "cache")]
    args += ["--cache-bytes", "1000", "--socket", str(tmp / "sock")]
    return subprocess.run(
        [*wrapper, sys.executable, "-m", "sandfleet.ondemand", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_a_failed_mount_exits_2_with_a_message(tmp_path: Path) -> None:
    # In a user namespace of its own, root of the namespace may not mount FUSE.
    proc = run_daemon(tmp_path, tmp_path / "mnt", "unshare", "--user", "--map-root-user")
    assert proc.returncode == 2, proc.stderr
    assert "cannot mount the FUSE file system" in proc.stderr
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    proc = run_daemon(tmp_path, not_a_dir)
    assert proc.returncode == 2, proc.stderr
    assert "is not a directory" in proc.stderr
    assert not mounts.mounts_under(tmp_path)


def test_start_reports_a_daemon_that_dies(tmp_path: Path) -> None:
    config = OnDemandConfig(tmp_path, tmp_path / "cache", 1 << 20, remotes=("ftp://nowhere",))
    with pytest.raises(FailedPrecondition, match="unsupported blob store URL"):
        OnDemand(tmp_path / "state", config).start()
    assert not mounts.is_mountpoint(tmp_path / "state" / "mnt")


class SlowStore(FileBlobStore):
    """A real file:// store whose reads take ``delay_s`` seconds each, counted."""

    def __init__(self, root: Path, delay_s: float) -> None:
        super().__init__(root)
        self.delay_s = delay_s
        self.gets = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes:
        with self._lock:
            self.gets += 1
        time.sleep(self.delay_s)
        return super().get(key)


def test_concurrent_reads_of_a_chunk_fetch_it_once(layer: BuiltLayer, tmp_path: Path) -> None:
    store = SlowStore(layer.remote, 0.3)
    fetcher = Fetcher(None, ChunkCache(tmp_path / "c", 1 << 30), [store], readahead=0)
    try:
        lay = Layer(layer.digest, layer.record)
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda i: fetcher.read(lay, i * 1000, 1000), range(8)))
        assert b"".join(got) == layer.blob[:8000]
        assert store.gets == 1 and fetcher.stats()["remote_chunks"] == 1
        assert fetcher.chunk(lay, 0) == layer.blob[:CHUNK] and store.gets == 1
    finally:
        fetcher.close()


def test_a_hanging_store_is_cut_off_at_the_deadline(layer: BuiltLayer, tmp_path: Path) -> None:
    store = SlowStore(layer.remote, 4.0)
    fetcher = Fetcher(None, ChunkCache(tmp_path / "c", 1 << 30), [store], deadline_s=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="within 1 s"):
            fetcher.read(Layer(layer.digest, layer.record), 0, 100)
        assert time.monotonic() - t0 < 3
        events, _ = fetcher.events()
        assert events and events[-1].chunk == 0
    finally:
        fetcher.close()
