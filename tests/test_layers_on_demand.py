"""Images loaded on demand through a whole deployment: a node with an empty image
store and an empty chunk cache pulls an image's metadata from a real nginx, mounts
its layers over the FUSE daemon, and fetches only the chunks its sandboxes read.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandfleet import NotFound, Unavailable
from sandfleet.blobstore import AccessList, FileBlobStore, open_store
from sandfleet.blobstore import keys as K
from sandfleet.blobstore.transfer import push
from sandfleet.cli.local import LocalDeployment
from sandfleet.images import ImageStore, build_from_directory, busybox_tree
from sandfleet.sdk import Client
from tests.conftest import assert_clean

pytestmark = pytest.mark.root

IMAGE = "od/base:1"
BIG_MIB = 40
BIG_MD5: list[str] = []  # of /data/big.bin, set by the source fixture


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> ImageStore:
    """A store where the images were built: busybox plus 40 MiB nobody reads at start,
    and two versions of a workspace layer."""
    store = ImageStore(tmp_path_factory.mktemp("source-images"))
    tree = tmp_path_factory.mktemp("od-tree")
    busybox_tree(tree)
    (tree / "data").mkdir()
    big = os.urandom(BIG_MIB << 20)
    (tree / "data" / "big.bin").write_bytes(big)
    BIG_MD5.append(hashlib.md5(big).hexdigest())
    (tree / "data" / "small.txt").write_text("small\n")
    build_from_directory(store, IMAGE, tree)
    for version in (1, 2):
        ws = tmp_path_factory.mktemp(f"ws{version}")
        (ws / "workspace").mkdir()
        (ws / "workspace" / "code.py").write_text(f"VERSION = {version}\n")
        (ws / "workspace" / "blob.bin").write_bytes(os.urandom(3 << 20))
        build_from_directory(store, f"od/ws:{version}", ws, kind="workspace")
    return store


@pytest.fixture
def remote(source: ImageStore, nginx_store: tuple[str, Path]) -> tuple[str, Path]:
    url, root = nginx_store
    with open_store(url) as dst:
        for ref in (IMAGE, "od/ws:1", "od/ws:2"):
            push(source.blobs, dst, ref)
    return url, root


def _node(tmp: Path, url: str, **env: str) -> LocalDeployment:
    os.environ.update(env)
    try:
        dep = LocalDeployment(tmp / "state", tmp / "images", extra_args=["--blob-store", url])
        dep.start()
    finally:
        for k in env:
            os.environ.pop(k, None)
    return dep


@pytest.fixture
def node(tmp_path: Path, remote: tuple[str, Path]) -> Iterator[LocalDeployment]:
    dep = _node(tmp_path, remote[0])
    try:
        yield dep
    finally:
        dep.stop()
    assert_clean(dep.state_dir)


def stats(dep: LocalDeployment) -> dict[str, Any]:
    return dict(dep.node_get("/v1/layers/stats"))


def remote_bytes(s: dict[str, Any]) -> int:
    return int(s["fetcher"]["remote_bytes"])


def test_a_cold_node_fetches_only_what_its_sandbox_reads(
    node: LocalDeployment, source: ImageStore
) -> None:
    image_bytes = sum(x.size for x in source.resolve(IMAGE).layers)
    with Client(node.url) as client, client.create(image=IMAGE) as sb:
        r = sb.exec(["cat", "/data/small.txt"])
        assert r.ok and r.stdout == b"small\n", r
        cold = remote_bytes(stats(node))
        assert 0 < cold < image_bytes * 0.25, (cold, image_bytes)
        # the metadata came with the pull; the data only as read
        assert (node.images_dir / "manifests" / "od" / "base" / "1.json").is_file()
        assert not list((node.images_dir / "chunks").rglob("*"))
        r = sb.exec("md5sum /data/big.bin", timeout_s=120)
        assert r.ok and r.stdout.split()[0].decode() == BIG_MD5[-1]
        assert remote_bytes(stats(node)) >= BIG_MIB << 20
        assert sb.events() == []


def test_big_file_reads_back_byte_for_byte(node: LocalDeployment) -> None:
    with Client(node.url) as client, client.create(image=IMAGE) as sb:
        got = sb.files.read("/data/big.bin")
    assert len(got) == BIG_MIB << 20 and hashlib.md5(got).hexdigest() == BIG_MD5[-1]


def test_a_rebuilt_workspace_refetches_only_itself(node: LocalDeployment) -> None:
    with Client(node.url) as client:
        with client.create(image=IMAGE, workspace="od/ws:1") as sb:
            r = sb.exec("cat /data/big.bin /workspace/blob.bin | wc -c", timeout_s=120)
            assert r.ok and int(r.stdout) == (BIG_MIB + 3) << 20
        before = stats(node)
        with client.create(image=IMAGE, workspace="od/ws:2") as sb:
            r = sb.exec("cat /data/big.bin /workspace/blob.bin | wc -c", timeout_s=120)
            assert r.ok and int(r.stdout) == (BIG_MIB + 3) << 20
            assert sb.exec("cat /workspace/code.py").stdout == b"VERSION = 2\n"
    # The base layer is mounted already (and its chunks cached): only ws:2 came.
    fetched = remote_bytes(stats(node)) - remote_bytes(before)
    assert 0 < fetched <= (3 << 20) + (1 << 20), fetched


def test_an_image_no_store_has_is_not_found(
    node: LocalDeployment, remote: tuple[str, Path]
) -> None:
    with Client(node.url) as client, pytest.raises(NotFound, match=r"od/none:1") as e:
        client.create(image="od/none:1")
    assert remote[0] in str(e.value)


def test_an_unreachable_store_fails_the_create_quickly(tmp_path: Path) -> None:
    dep = _node(tmp_path, "http://127.0.0.1:1/store")
    try:
        t0 = time.monotonic()
        with Client(dep.url) as client, pytest.raises(Unavailable, match=r"127\.0\.0\.1:1"):
            client.create(image=IMAGE)
        assert time.monotonic() - t0 < 30
    finally:
        dep.stop()
    assert_clean(dep.state_dir)


def test_a_store_failing_mid_run_gives_eio_and_an_event(
    tmp_path: Path, remote: tuple[str, Path], source: ImageStore
) -> None:
    dep = _node(tmp_path, remote[0], SANDFLEET_FETCH_DEADLINE_S="3")
    try:
        with Client(dep.url) as client, client.create(image=IMAGE) as sb:
            assert sb.exec(["cat", "/data/small.txt"]).ok
            # Every chunk of the layer is now corrupt in the store: reads of data
            # not fetched yet fail (digest check), bounded by the deadline.
            record = source.layer_record(source.resolve(IMAGE).layers[0].digest)
            for c in set(record.chunks):
                path = remote[1] / K.chunk_key(c)
                path.write_bytes(b"corrupt" + path.read_bytes()[7:])
            t0 = time.monotonic()
            r = sb.exec("cat /data/big.bin > /dev/null", timeout_s=60)
            assert time.monotonic() - t0 < 30
            assert not r.ok and b"Input/output error" in r.stderr, r
            events = sb.events()
            assert events and events[0].kind == "layer_fetch_error"
            assert "sha256:" in events[0].message
    finally:
        dep.stop()
    assert_clean(dep.state_dir)


def test_start_up_reads_are_recorded_and_prefetched_on_the_next_node(
    tmp_path: Path, remote: tuple[str, Path], source: ImageStore
) -> None:
    layer = source.resolve(IMAGE).layers[0].digest
    first = _node(tmp_path / "first", remote[0])
    try:
        with Client(first.url) as client, client.create(image=IMAGE) as sb:
            assert sb.exec(["cat", "/data/small.txt"]).ok
        # recorded on the node, and shared through the store for the others
        assert (first.images_dir / K.access_key(layer)).is_file()
        assert FileBlobStore(remote[1]).exists(K.access_key(layer))
    finally:
        first.stop()
    assert_clean(first.state_dir)

    second = _node(tmp_path / "second", remote[0])
    try:
        with Client(second.url) as client, client.create(image=IMAGE) as sb:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                s = stats(second)["fetcher"]
                if s["background_queued"] and not s["inflight"]:
                    break
                time.sleep(0.1)
            s = stats(second)
            assert s["fetcher"]["background_queued"] > 0, s
            # every chunk start-up read on the first node is in this node's cache
            # before its sandbox reads anything (read-ahead around it may vary)
            access = AccessList.model_validate_json(
                (first.images_dir / K.access_key(layer)).read_bytes()
            )
            record = source.layer_record(layer)
            cached = {p.name for p in (second.state_dir / "nodes").glob("*/chunk-cache/**/*")}
            assert {K.digest_hex(record.chunks[i]) for i in access.chunks} <= cached
            hits = s["fetcher"]["hits_cache"]
            assert sb.exec(["cat", "/data/small.txt"]).ok
            assert stats(second)["fetcher"]["hits_cache"] > hits
    finally:
        second.stop()
    assert_clean(second.state_dir)


def test_local_gc_keeps_the_layers_running_sandboxes_mounted(tmp_path: Path) -> None:
    images = tmp_path / "images"
    store = ImageStore(images)
    tree = tmp_path / "tree"
    busybox_tree(tree)
    (tree / "data.bin").write_bytes(os.urandom(3 << 20))
    build_from_directory(store, "gc/one:1", tree)
    dep = LocalDeployment(tmp_path / "state", images)
    with dep, Client(dep.url) as client, client.create(image="gc/one:1") as sb:
        store.remove("gc/one:1")
        assert store.gc(min_age_s=0).deleted == []  # mounted: kept
        Path("/proc/sys/vm/drop_caches").write_text("3\n")  # reads must reach the data
        assert sb.exec("md5sum /data.bin").ok
    # unmounted once its sandbox and the node are gone: collectable
    assert_clean(dep.state_dir)
    assert len(store.gc(min_age_s=0).deleted) > 0
    assert store.blobs.list("chunks/") == []


def test_a_workspace_built_on_its_image_stacks_each_layer_once(
    node: LocalDeployment, source: ImageStore, remote: tuple[str, Path], tmp_path: Path
) -> None:
    ws = tmp_path / "ws"
    (ws / "workspace").mkdir(parents=True)
    (ws / "workspace" / "x").write_text("x\n")
    build_from_directory(source, "od/ws-on:1", ws, kind="workspace", on=IMAGE)
    with open_store(remote[0]) as dst:
        push(source.blobs, dst, "od/ws-on:1")
    with Client(node.url) as client, client.create(image=IMAGE, workspace="od/ws-on:1") as sb:
        assert sb.exec("cat /workspace/x /data/small.txt").stdout == b"x\nsmall\n"


def test_a_dead_daemon_is_started_again_for_new_sandboxes(node: LocalDeployment) -> None:
    with Client(node.url) as client, client.create(image=IMAGE) as before:
        assert before.exec(["cat", "/data/small.txt"]).ok
        os.kill(stats(node)["pid"], signal.SIGKILL)
        time.sleep(0.5)
        with client.create(image=IMAGE) as after:
            r = after.exec("cat /data/small.txt && md5sum /data/big.bin", timeout_s=120)
            assert r.ok and r.stdout.startswith(b"small\n"), r
            assert BIG_MD5[-1].encode() in r.stdout
        assert any("daemon died" in e.message for e in before.events())


def test_a_tag_pushed_again_reaches_a_node_that_pulled_it(
    tmp_path: Path, remote: tuple[str, Path], source: ImageStore
) -> None:
    def tag(version: int) -> None:  # od/ws:moving holds what od/ws:<version> holds
        source.put(source.resolve(f"od/ws:{version}").model_copy(update={"tag": "moving"}))
        with open_store(remote[0]) as dst:
            push(source.blobs, dst, "od/ws:moving")

    tag(1)
    dep = _node(tmp_path, remote[0], SANDFLEET_MANIFEST_TTL_S="0")
    try:
        with Client(dep.url) as client:
            with client.create(image=IMAGE, workspace="od/ws:moving") as sb:
                assert sb.exec("cat /workspace/code.py").stdout == b"VERSION = 1\n"
            tag(2)
            with client.create(image=IMAGE, workspace="od/ws:moving") as sb:
                assert sb.exec("cat /workspace/code.py").stdout == b"VERSION = 2\n"
    finally:
        dep.stop()
    assert_clean(dep.state_dir)
