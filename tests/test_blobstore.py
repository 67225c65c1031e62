"""Blob stores (file:// and a real nginx over http://), and images copied between them."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from sandfleet.blobstore import (
    AccessList,
    BlobStore,
    FileBlobStore,
    LayerRecord,
    ObjectRef,
    open_store,
)
from sandfleet.blobstore import keys as K
from sandfleet.blobstore.http import HttpBlobStore
from sandfleet.blobstore.transfer import gc, list_images, pull, push
from sandfleet.wire.errors import DataLoss, InvalidArgument, NotFound, PermissionDenied, Unavailable
from sandfleet.wire.models import ImageManifest, LayerDescriptor
from tests.nginx import free_port, nginx_server

CHUNK = 4096


@pytest.fixture(params=["file", "http"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlobStore]:
    """The same contract, once per backend."""
    if request.param == "file":
        yield FileBlobStore(tmp_path / "store")
    else:
        url, _ = request.getfixturevalue("nginx_store")
        with HttpBlobStore(url, timeout_s=5) as s:
            yield s


# --------------------------------------------------------------------------- the contract


def test_put_get_exists_delete(store: BlobStore) -> None:
    key = "chunks/sha256/" + "a" * 64
    assert not store.exists(key)
    store.put(key, b"hello")
    assert store.exists(key)
    assert store.get(key) == b"hello"
    store.put("top", b"")
    assert store.get("top") == b""
    store.delete(key)
    assert not store.exists(key)
    with pytest.raises(NotFound, match=key):
        store.get(key)
    store.delete(key)  # missing: not an error


def test_missing_key_is_not_found(store: BlobStore) -> None:
    assert not store.exists("nothing")
    with pytest.raises(NotFound):
        store.get("nothing")


def test_folder_is_not_an_object(store: BlobStore) -> None:
    store.put("a/b/c", b"x")
    for key in ("a/b", "a/b/c/d"):
        assert not store.exists(key)
        with pytest.raises(NotFound):
            store.get(key)


def test_list(store: BlobStore) -> None:
    before = time.time()
    store.put("a/b/c", b"123")
    store.put("a/d", b"45")
    store.put("e", b"6")
    found = {o.key: o for o in store.list("a/")}
    assert set(found) == {"a/b/c", "a/d"}
    assert (found["a/b/c"].size, found["a/d"].size) == (3, 2)
    assert all(before - 2 <= o.mtime <= time.time() + 2 for o in found.values())
    assert {o.key for o in store.list("")} == {"a/b/c", "a/d", "e"}
    assert {o.key for o in store.list("a/b/")} == {"a/b/c"}
    assert store.list("nope/") == []


def test_overwrite_is_atomic(store: BlobStore) -> None:
    one, two = b"1" * (1 << 20), b"2" * (1 << 20)
    store.put("obj", one)
    seen: set[bytes] = set()
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            seen.add(store.get("obj"))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(20):
            store.put("obj", two if i % 2 == 0 else one)
    finally:
        stop.set()
        reader.join()
    assert seen <= {one, two}
    assert store.get("obj") == one


@pytest.mark.parametrize("key", ["", "/abs", "../x", "a/../b", "a//b", ".hidden", "a/", "a b"])
def test_bad_keys_are_invalid(store: BlobStore, key: str) -> None:
    for call in (store.get, store.exists, store.delete, lambda k: store.put(k, b"x")):
        with pytest.raises(InvalidArgument):
            call(key)


def test_open_store(tmp_path: Path) -> None:
    assert isinstance(open_store(f"file://{tmp_path}"), FileBlobStore)
    assert isinstance(open_store(str(tmp_path)), FileBlobStore)
    with open_store("http://127.0.0.1:1/x") as s:
        assert isinstance(s, HttpBlobStore)
    with pytest.raises(InvalidArgument):
        open_store("s3://bucket")


# --------------------------------------------------------------------------- http specifics


def test_http_range_reads(nginx_store: tuple[str, Path]) -> None:
    url, root = nginx_store
    data = os.urandom(10_000)
    with HttpBlobStore(url, timeout_s=5) as s:
        s.put("blob", data)
        assert (root / "blob").read_bytes() == data
        assert s.get_range("blob", 0, 100) == data[:100]
        assert s.get_range("blob", 4096, 4096) == data[4096:8192]
        assert s.get_range("blob", 9_990, 100) == data[9_990:]  # short at the end
        assert s.get_range("blob", 5, 0) == b""
        with pytest.raises(InvalidArgument):
            s.get_range("blob", 20_000, 10)
        with pytest.raises(NotFound):
            s.get_range("missing", 0, 10)


def test_http_nothing_listening_is_unavailable_fast() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with HttpBlobStore(url, timeout_s=5) as s:
        start = time.monotonic()
        with pytest.raises(Unavailable, match=url):
            s.get("k")
        with pytest.raises(Unavailable):
            s.put("k", b"x")
        with pytest.raises(Unavailable):
            s.list("")
        assert time.monotonic() - start < 2


def test_http_server_that_never_answers_is_unavailable_within_timeout() -> None:
    with socket.socket() as listener:  # the kernel accepts connections; nobody answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with HttpBlobStore(url, timeout_s=0.5) as s:
            start = time.monotonic()
            with pytest.raises(Unavailable, match=r"no answer within 0\.5s"):
                s.get("k")
            assert time.monotonic() - start < 3


def test_http_read_only_server(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "obj").write_bytes(b"data")
    with nginx_server(tmp_path, dav=False) as url, HttpBlobStore(url, timeout_s=5) as s:
        assert s.get("a/obj") == b"data"
        assert [o.key for o in s.list("a/")] == ["a/obj"]
        with pytest.raises(PermissionDenied, match="dav_methods PUT DELETE"):
            s.put("a/new", b"x")
        with pytest.raises(PermissionDenied, match="dav_methods PUT DELETE"):
            s.delete("a/obj")
    assert (tmp_path / "a" / "obj").exists()


# --------------------------------------------------------------------------- transfer


def make_image(
    store: BlobStore, ref: str, n_chunks: int = 5, shared: bytes | None = None
) -> tuple[ImageManifest, LayerRecord]:
    """A fake one-layer image: random chunks (plus ``shared``), a metadata object, an
    access list, a manifest."""
    blobs = [os.urandom(CHUNK) for _ in range(n_chunks - 1)] + [os.urandom(100)]
    if shared is not None:
        blobs.insert(0, shared)
    for data in blobs:
        store.put(K.chunk_key(K.sha256_digest(data)), data)
    meta = os.urandom(3000)
    store.put(K.meta_key(K.sha256_digest(meta)), meta)
    record = LayerRecord(
        meta=ObjectRef(digest=K.sha256_digest(meta), size=len(meta)),
        blob_size=sum(len(b) for b in blobs),
        chunk_size=CHUNK,
        chunks=[K.sha256_digest(b) for b in blobs],
    )
    digest = record.digest()
    store.put(K.layer_key(digest), record.to_bytes())
    access = AccessList(layer=digest, chunks=[0, 2])
    store.put(K.access_key(digest), access.model_dump_json().encode())
    name, _, tag = ref.partition(":")
    manifest = ImageManifest(
        name=name,
        tag=tag,
        kind="base",
        layers=[LayerDescriptor(digest=digest, size=record.size, kind="base")],
    )
    store.put(K.manifest_key(name, tag), manifest.model_dump_json().encode())
    return manifest, record


def files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and not p.relative_to(root).as_posix().startswith("tmp/")
    }


def test_push_then_pull(tmp_path: Path, nginx_store: tuple[str, Path]) -> None:
    url, remote_root = nginx_store
    local = FileBlobStore(tmp_path / "local")
    manifest, record = make_image(local, "test/app:1")
    with HttpBlobStore(url, timeout_s=5) as remote:
        stats = push(local, remote, "test/app:1")
        assert files(remote_root) == files(local.root)
        n_objects = len(files(local.root))
        assert (stats.copied, stats.present) == (n_objects, 0)
        assert stats.copied_bytes == sum(len(b) for b in files(local.root).values())
        assert [m.ref for m in list_images(remote)] == ["test/app:1"]

        again = push(local, remote, "test/app:1")
        assert (again.copied, again.copied_bytes, again.present) == (0, 0, n_objects)

        node = FileBlobStore(tmp_path / "node")
        pulled = pull(remote, node, "test/app:1")
        got = files(node.root)
        assert not any(k.startswith("chunks/") for k in got)
        assert got == {k: v for k, v in files(local.root).items() if not k.startswith("chunks/")}
        assert pulled.copied == len(got) == 4  # manifest, record, metadata, access list
        assert ImageManifest.model_validate_json(node.get(K.manifest_key("test/app", "1"))) == (
            manifest
        )

        with_data = pull(remote, node, "test/app:1", data=True)
        assert files(node.root) == files(local.root)
        assert with_data.copied == len(record.chunks)
        assert with_data.present == 4


def test_missing_image_names_the_store_and_its_images(tmp_path: Path) -> None:
    src = FileBlobStore(tmp_path / "src")
    make_image(src, "test/a:1")
    make_image(src, "test/b:2")
    with pytest.raises(NotFound) as e:
        push(src, FileBlobStore(tmp_path / "dst"), "test/c:1")
    assert src.url in e.value.message
    assert "test/a:1, test/b:2" in e.value.message
    with pytest.raises(NotFound, match="images there: none"):
        pull(FileBlobStore(tmp_path / "empty"), src, "test/a:1")


def test_corrupt_source_object_is_data_loss(tmp_path: Path, nginx_store: tuple[str, Path]) -> None:
    url, remote_root = nginx_store
    local = FileBlobStore(tmp_path / "local")
    _, record = make_image(local, "test/app:1")
    with HttpBlobStore(url, timeout_s=5) as remote:
        push(local, remote, "test/app:1")
        meta_file = remote_root / K.meta_key(record.meta.digest)
        meta_file.write_bytes(b"not the metadata")
        node = FileBlobStore(tmp_path / "node")
        with pytest.raises(DataLoss, match=K.meta_key(record.meta.digest)):
            pull(remote, node, "test/app:1")
        assert not node.exists(K.manifest_key("test/app", "1"))  # never half an image
        assert not node.exists(K.meta_key(record.meta.digest))

        chunk = remote_root / K.chunk_key(record.chunks[1])
        chunk.write_bytes(b"x" + chunk.read_bytes()[1:])
        meta_file.write_bytes(local.get(K.meta_key(record.meta.digest)))
        pull(remote, node, "test/app:1")  # without data the chunk is not read
        with pytest.raises(DataLoss, match=record.chunks[1].removeprefix("sha256:")):
            pull(remote, node, "test/app:1", data=True)


def test_push_to_read_only_server_is_permission_denied(tmp_path: Path) -> None:
    local = FileBlobStore(tmp_path / "local")
    make_image(local, "test/app:1")
    served = tmp_path / "served"
    served.mkdir()
    with (
        nginx_server(served, dav=False) as url,
        HttpBlobStore(url, timeout_s=5) as remote,
        pytest.raises(PermissionDenied, match="create_full_put_path on"),
    ):
        push(local, remote, "test/app:1")
    assert list(served.iterdir()) == []


def age(root: Path, seconds: float) -> None:
    """Make every file under ``root`` ``seconds`` older."""
    for p in root.rglob("*"):
        if p.is_file():
            t = p.stat().st_mtime - seconds
            os.utime(p, (t, t))


@pytest.mark.parametrize("backend", ["file", "http"])
def test_gc(tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    if backend == "file":
        store: BlobStore = FileBlobStore(tmp_path / "store")
        root = tmp_path / "store"
    else:
        url, root = request.getfixturevalue("nginx_store")
        store = HttpBlobStore(url, timeout_s=5)
    with store:
        shared = os.urandom(CHUNK)
        _, rec_a = make_image(store, "test/a:1", shared=shared)
        manifest_b, rec_b = make_image(store, "test/b:1", shared=shared)
        store.put("other/keep-me", b"not gc's business")
        store.delete(K.manifest_key("test/a", "1"))  # image a removed
        before = files(root)

        assert gc(store, min_age_s=3600).deleted == []  # all too young: a push in progress?
        assert files(root) == before

        age(root, 7200)
        stats = gc(store, min_age_s=3600)
        shared_key = K.chunk_key(K.sha256_digest(shared))
        only_a = {
            K.layer_key(rec_a.digest()),
            K.access_key(rec_a.digest()),
            K.meta_key(rec_a.meta.digest),
            *(K.chunk_key(c) for c in rec_a.chunks),
        } - {shared_key}
        assert set(stats.deleted) == only_a
        assert stats.deleted_bytes == sum(len(before[k]) for k in only_a)
        assert files(root) == {k: v for k, v in before.items() if k not in only_a}
        assert store.exists(shared_key)
        assert all(store.exists(K.chunk_key(c)) for c in rec_b.chunks)
        assert [m.ref for m in list_images(store)] == [manifest_b.ref]
        assert gc(store, min_age_s=0).deleted == []


def test_gc_keeps_what_a_young_layer_record_references(tmp_path: Path) -> None:
    """A push writes the record before chunks that may already be there (old, unreferenced)."""
    store = FileBlobStore(tmp_path / "store")
    _, record = make_image(store, "test/a:1")
    store.delete(K.manifest_key("test/a", "1"))
    age(store.root, 7200)
    os.utime(store.path(K.layer_key(record.digest())))  # the record is fresh again
    assert gc(store, min_age_s=3600).deleted == []
    age(store.root, 7200)
    assert len(gc(store, min_age_s=3600).deleted) == len(record.chunks) + 3


# --------------------------------------------------------------------------- CLI


def test_cli_push_pull_ls_gc(tmp_path: Path, nginx_store: tuple[str, Path]) -> None:
    from sandfleet.cli import images as _registers_image  # noqa: F401 - the `image` group
    from sandfleet.cli.main import cli

    url, _ = nginx_store
    local = tmp_path / "local"
    make_image(FileBlobStore(local), "test/app:1")
    runner = CliRunner()

    def run(*args: str) -> str:
        state = ["--state-dir", str(tmp_path / "state")]
        result = runner.invoke(cli, [*args, *state], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    out = run("image", "push", "test/app:1", url, "--images-dir", str(local))
    assert "pushed test/app:1" in out and "9 objects" in out
    assert "test/app:1" in run("image", "ls", "--store", url)
    node = tmp_path / "node"
    out = run("image", "pull", "test/app:1", url, "--images-dir", str(node))
    assert "4 objects" in out
    assert not (node / "chunks").exists()
    run("image", "pull", "test/app:1", url, "--images-dir", str(node), "--data")
    assert len(list((node / "chunks").rglob("*"))) == 6  # sha256/ and 5 chunks
    out = run("image", "gc", "--store", url, "--min-age", "0")
    assert "deleted 0 unreferenced objects" in out
    FileBlobStore(node).delete(K.manifest_key("test/app", "1"))
    out = run("image", "gc", "--images-dir", str(node), "--min-age", "0")
    assert "deleted 8 unreferenced objects" in out
