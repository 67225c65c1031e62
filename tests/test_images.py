"""Images: refs, mirror resolution, the layer store, EROFS packing and the builders."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandfleet.blobstore import DEFAULT_CHUNK_SIZE, LayerRecord, ObjectRef
from sandfleet.blobstore import keys as K
from sandfleet.images import (
    ImageStore,
    build_debootstrap,
    build_from_directory,
    build_workspace,
    classify_source,
    pack_erofs,
    parse_ref,
    resolve_mirror,
    stack_for,
)
from sandfleet.images.extract import extract_archive
from sandfleet.node import mounts
from sandfleet.wire.errors import Internal, InvalidArgument, NotFound
from sandfleet.wire.models import ImageConfig, ImageManifest, LayerKind
from tests.layers import blob_from_chunks, mount_split, store_keys

IS_ROOT = os.geteuid() == 0
root_only = pytest.mark.skipif(not IS_ROOT, reason="needs root (EROFS mounts, chown)")
has_mkfs = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "store")


#: Mounts an EROFS image read-only: (metadata image, data blob or None) -> mount point.
MountLayer = Callable[[Path, Path | None], Path]
#: Mounts a layer of an image store, its blob reassembled from the chunks: digest -> mount point.
MountStored = Callable[[ImageStore, str], Path]


@pytest.fixture
def mount_layer(tmp_path: Path) -> Iterator[MountLayer]:
    """Mount an EROFS image read-only (a split one with its blob as ``device=``);
    everything is unmounted at teardown."""
    points: list[Path] = []

    def do_mount(meta: Path, blob: Path | None) -> Path:
        mp = tmp_path / f"mnt{len(points)}"
        mp.mkdir()
        mount_split(meta, blob, mp)
        points.append(mp)
        return mp

    yield do_mount
    for mp in reversed(points):
        mounts.umount(mp, mounts.MNT_DETACH)
    assert mounts.mounts_under(tmp_path) == []


@pytest.fixture
def mount_stored(tmp_path: Path, mount_layer: MountLayer) -> MountStored:
    """Mount layer ``digest`` of a store: its metadata image with the blob rebuilt from chunks."""

    def do_mount(store: ImageStore, digest: str) -> Path:
        record = store.layer_record(digest)
        blob = blob_from_chunks(store, record, tmp_path / f"{K.digest_hex(digest)}.blob")
        return mount_layer(store.meta_path(record), blob)

    return do_mount


def put_image(
    store: ImageStore, ref: str, content: bytes, kind: LayerKind = "base", **cfg: Any
) -> None:
    """Store a one-layer image: ``content`` as its metadata "image", ``b"data:" + content``
    as its blob."""
    name, tag = parse_ref(ref)
    stem = store.root.parent / f"{name.replace('/', '_')}-{tag}"
    meta = _write(stem.with_suffix(".meta"), content)
    blob = _write(stem.with_suffix(".blob"), b"data:" + content)
    layer = store.add_layer(meta, blob, kind)
    manifest = ImageManifest(
        name=name, tag=tag, kind=kind, layers=[layer], config=ImageConfig(**cfg)
    )
    store.put(manifest)


def layer_keys(store: ImageStore, digest: str) -> set[str]:
    """Every key layer ``digest`` is made of in the store: record, metadata and chunks."""
    record = store.layer_record(digest)
    keys = {K.layer_key(digest), K.meta_key(record.meta.digest)}
    return keys | {K.chunk_key(c) for c in record.chunks}


def all_objects(store: ImageStore) -> list[str]:
    """Every layer record, metadata image and chunk in the store, sorted."""
    return sorted(
        k for prefix in ("layers/", "metas/", "chunks/") for k in store_keys(store, prefix)
    )


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# --------------------------------------------------------------------------- refs


def test_parse_ref_defaults_tag_to_latest() -> None:
    assert parse_ref("debian") == ("debian", "latest")
    assert parse_ref("team/py3.11:v1.2_rc-1") == ("team/py3.11", "v1.2_rc-1")


@pytest.mark.parametrize(
    "ref",
    ["Debian", "-x", "a//b", "a/../b", "../etc", "a/", "a:", "a:b:c", "a:t t", "", "a" * 129],
)
def test_invalid_refs_say_what_is_allowed(ref: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        parse_ref(ref)
    msg = exc.value.message
    assert "name[:tag]" in msg or "lowercase letters" in msg or "letters, digits" in msg


# --------------------------------------------------------------------------- mirror

DEBIAN_DEB822 = """\
Types: deb
# a comment inside the stanza
URIs: http://deb.example.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://disabled.example.org/debian
Suites: bookworm
Components: main
Enabled: no

Types: deb deb-src
URIs: http://mirror.example.org/debian http://second.example.org/debian
Suites: bookworm bookworm-updates
Components: main contrib
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""

THIRD_PARTY_LIST = """\
# docker uses a plain suite but its own key and component
deb [arch=amd64 signed-by=/etc/apt/keyrings/docker.asc] \
https://download.docker.example/linux/debian bookworm stable
deb https://packages.cloud.example/apt cloud-sdk-bookworm main
deb http://repo.example.net/php bookworm main
deb-src http://src.example.org/debian bookworm main
"""


def apt_dir(tmp_path: Path, files: dict[str, str]) -> Path:
    d = tmp_path / "apt"
    (d / "sources.list.d").mkdir(parents=True)
    for name, text in files.items():
        (d / name).write_text(text)
    return d


def test_mirror_from_host_sources_skips_third_party_security_and_disabled(tmp_path: Path) -> None:
    d = apt_dir(
        tmp_path,
        {
            "sources.list": THIRD_PARTY_LIST,
            "sources.list.d/00-thirdparty.sources": (
                "Types: deb\nURIs: https://deb.nodesource.example/node_20.x\nSuites: nodistro\n"
                "Components: main\nSigned-By: /usr/share/keyrings/nodesource.gpg\n"
            ),
            "sources.list.d/debian.sources": DEBIAN_DEB822,
            "sources.list.d/zz.list.off": "deb http://off.example.org/debian bookworm main\n",
        },
    )
    assert resolve_mirror(apt_dir=d, environ={}) == "http://mirror.example.org/debian"


def test_mirror_from_one_line_list(tmp_path: Path) -> None:
    d = apt_dir(
        tmp_path,
        {
            "sources.list": (
                "deb http://deb.example.org/debian bookworm-updates main\n"
                "deb [ signed-by=/usr/share/keyrings/debian-archive-keyring.gpg ] "
                "http://ftp.example.org/debian/ bookworm main non-free-firmware # trailing\n"
            )
        },
    )
    assert resolve_mirror(apt_dir=d, environ={}) == "http://ftp.example.org/debian/"


def test_mirror_precedence_argument_then_env_then_host(tmp_path: Path) -> None:
    d = apt_dir(tmp_path, {"sources.list.d/debian.sources": DEBIAN_DEB822})
    env = {"SANDFLEET_DEBIAN_MIRROR": "http://env.example.org/debian"}
    assert resolve_mirror("http://arg.example.org/debian", apt_dir=d, environ=env) == (
        "http://arg.example.org/debian"
    )
    assert resolve_mirror(apt_dir=d, environ=env) == "http://env.example.org/debian"
    assert resolve_mirror(apt_dir=d, environ={}) == "http://mirror.example.org/debian"


def test_no_mirror_explains_how_to_set_one(tmp_path: Path) -> None:
    d = apt_dir(tmp_path, {"sources.list": THIRD_PARTY_LIST})
    with pytest.raises(InvalidArgument, match="SANDFLEET_DEBIAN_MIRROR"):
        resolve_mirror(apt_dir=d, environ={})


def test_debootstrap_validates_before_doing_work(store: ImageStore, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="package name"):
        build_debootstrap(store, "deb:1", ["python3; rm -rf /"], mirror="http://x.example/debian")
    with pytest.raises(InvalidArgument, match="SANDFLEET_DEBIAN_MIRROR"):
        os.environ.pop("SANDFLEET_DEBIAN_MIRROR", None)
        build_debootstrap(store, "deb:1", [], apt_dir=apt_dir(tmp_path, {}))
    assert list(store.tmp_dir.iterdir()) == []


# --------------------------------------------------------------------------- store


def test_unknown_image_lists_existing_and_says_how_to_build(store: ImageStore) -> None:
    put_image(store, "debian/py:1", b"base layer")
    put_image(store, "tools:latest", b"tools layer", kind="toolkit")
    with pytest.raises(NotFound) as exc:
        store.resolve("nope")
    msg = exc.value.message
    assert "nope:latest" in msg
    assert "debian/py:1" in msg and "tools:latest" in msg
    assert "sandfleet image build" in msg


def test_store_roundtrip_list_remove_prune(store: ImageStore) -> None:
    put_image(store, "a:1", b"layer-a")
    put_image(store, "b", b"layer-b")
    m = store.resolve("a:1")
    assert (m.name, m.tag, m.kind) == ("a", "1", "base")
    path = store.root / "manifests" / "a" / "1.json"
    assert json.loads(path.read_text())["layers"][0]["digest"] == m.layers[0].digest
    assert [x.ref for x in store.list()] == ["a:1", "b:latest"]
    gone = layer_keys(store, m.layers[0].digest)
    kept = layer_keys(store, store.resolve("b").layers[0].digest)
    assert store.remove("a:1").ref == "a:1"
    with pytest.raises(NotFound):
        store.resolve("a:1")
    assert store.prune() == []  # too young to prune
    assert sorted(store.prune(min_age_s=0)) == sorted(gone)  # record, metadata and chunk
    assert not any(store.blobs.exists(k) for k in gone)
    assert all_objects(store) == sorted(kept)  # still referenced, kept
    assert store.resolve("b").layers


def test_add_layer_dedups_and_consumes_the_files(store: ImageStore, tmp_path: Path) -> None:
    meta, blob = b"metadata image", b"data blob"
    files = [
        _write(tmp_path / f"{n}-{i}", d) for i in (1, 2) for n, d in (("m", meta), ("b", blob))
    ]
    da, db = (
        store.add_layer(files[0], files[1], "base"),
        store.add_layer(files[2], files[3], "base"),
    )
    assert da == db and da.size == len(meta) + len(blob)
    record = LayerRecord(
        meta=ObjectRef(digest=K.sha256_digest(meta), size=len(meta)),
        blob_size=len(blob),
        chunk_size=DEFAULT_CHUNK_SIZE,
        chunks=[K.sha256_digest(blob)],
    )  # the record is the layer: its digest is the sha256 of the stored bytes
    assert da.digest == "sha256:" + hashlib.sha256(record.to_bytes()).hexdigest()
    assert store.layer_record(da.digest) == record
    assert store.blobs.path(K.layer_key(da.digest)).read_bytes() == record.to_bytes()
    assert store.meta_path(record).read_bytes() == meta
    assert store.blobs.path(K.chunk_key(record.chunks[0])).read_bytes() == blob
    assert not any(f.exists() for f in files)
    assert all_objects(store) == sorted(layer_keys(store, da.digest))  # each stored once
    assert store.has_data(record)
    assert list(store.tmp_dir.iterdir()) == []


def test_add_layer_cuts_the_blob_into_chunks_stored_once_across_layers(
    store: ImageStore, tmp_path: Path
) -> None:
    mib = 1 << 20
    shared = os.urandom(3 * mib)  # three whole chunks, the same in both layers
    one = store.add_layer(
        _write(tmp_path / "m1", b"meta one"), _write(tmp_path / "b1", shared + b"one"), "base"
    )
    two = store.add_layer(
        _write(tmp_path / "m2", b"meta two"), _write(tmp_path / "b2", shared + b"two!"), "diff"
    )
    r1, r2 = store.layer_record(one.digest), store.layer_record(two.digest)
    assert (r1.chunk_size, r1.blob_size, len(r1.chunks)) == (mib, 3 * mib + 3, 4)
    assert (r2.blob_size, len(r2.chunks), r2.chunk_length(3)) == (3 * mib + 4, 4, 4)
    assert r1.chunks[:3] == r2.chunks[:3] and r1.chunks[3] != r2.chunks[3]
    assert r1.chunks[:3] == [K.sha256_digest(shared[i * mib : (i + 1) * mib]) for i in range(3)]
    chunk_files = [store.blobs.path(k) for k in store_keys(store, "chunks/")]
    assert len(chunk_files) == 5  # 3 shared + 2 tails, not 8
    assert sum(f.stat().st_size for f in chunk_files) == 3 * mib + 3 + 4
    assert blob_from_chunks(store, r2, tmp_path / "again").read_bytes() == shared + b"two!"
    # Another chunk size: another record, and chunks of that size.
    small = store.add_layer(
        _write(tmp_path / "m3", b"meta one"),
        _write(tmp_path / "b3", shared + b"one"),
        "base",
        chunk_size=mib // 2,
    )
    r3 = store.layer_record(small.digest)
    assert small.digest != one.digest and (r3.chunk_size, len(r3.chunks)) == (mib // 2, 7)
    assert blob_from_chunks(store, r3, tmp_path / "small").read_bytes() == shared + b"one"


@pytest.mark.parametrize("chunk_size", [0, -4096, 1000, 4097, (1 << 20) + 512])
def test_add_layer_rejects_a_bad_chunk_size(
    store: ImageStore, tmp_path: Path, chunk_size: int
) -> None:
    meta, blob = _write(tmp_path / "m", b"meta"), _write(tmp_path / "b", b"blob")
    with pytest.raises(InvalidArgument, match="multiple of 4096"):
        store.add_layer(meta, blob, "base", chunk_size=chunk_size)
    assert all_objects(store) == []


def test_add_layer_needs_both_files_and_a_known_kind(store: ImageStore, tmp_path: Path) -> None:
    meta, blob = _write(tmp_path / "m", b"meta"), _write(tmp_path / "b", b"blob")
    with pytest.raises(NotFound, match="does not exist"):
        store.add_layer(meta, tmp_path / "missing", "base")
    with pytest.raises(NotFound, match="does not exist"):
        store.add_layer(tmp_path / "missing", blob, "base")
    with pytest.raises(InvalidArgument, match="invalid layer kind"):
        store.add_layer(meta, blob, "fncall")  # type: ignore[arg-type]
    assert all_objects(store) == []


def test_put_rejects_missing_layer_and_bad_digest(store: ImageStore) -> None:
    with pytest.raises(InvalidArgument, match="sha256"):
        store.layer_record("md5:abc")
    with pytest.raises(NotFound, match="is not in the store"):
        store.layer_record("sha256:" + "0" * 64)
    layer = {"digest": "sha256:" + "0" * 64, "size": 1, "kind": "base"}
    m = ImageManifest.model_validate({"name": "x", "tag": "1", "kind": "base", "layers": [layer]})
    with pytest.raises(NotFound, match="add_layer"):
        store.put(m)


def test_stack_for_orders_layers_and_merges_config(store: ImageStore) -> None:
    put_image(store, "os:1", b"os", env={"PATH": "/bin", "A": "1"}, workdir="/root")
    put_image(store, "ws:1", b"ws", kind="workspace", env={"A": "2"}, workdir="/workspace")
    stack, cfg = stack_for(store, "os:1", "ws:1")
    assert [x.meta.read_bytes() for x in stack] == [b"os", b"ws"]
    digests = [store.resolve(ref).layers[0].digest for ref in ("os:1", "ws:1")]
    assert [x.digest for x in stack] == digests
    assert [x.record for x in stack] == [store.layer_record(d) for d in digests]
    assert [x.meta for x in stack] == [store.meta_path(x.record) for x in stack]
    assert cfg == ImageConfig(env={"PATH": "/bin", "A": "2"}, workdir="/workspace")
    stack, cfg = stack_for(store, "os:1")
    assert len(stack) == 1 and cfg.workdir == "/root"
    with pytest.raises(InvalidArgument, match="workspace"):
        stack_for(store, "ws:1")
    with pytest.raises(InvalidArgument, match="not a workspace"):
        stack_for(store, "os:1", "os:1")


def test_stack_for_a_layer_missing_from_the_store_says_pull_or_rebuild(
    store: ImageStore,
) -> None:
    put_image(store, "os:1", b"os")
    put_image(store, "ws:1", b"ws", kind="workspace")
    ws = store.resolve("ws:1").layers[0].digest
    record = store.layer_record(ws)
    store.meta_path(record).unlink()  # the record is there, its metadata image is not
    with pytest.raises(NotFound, match="pull") as exc:
        stack_for(store, "os:1", "ws:1")
    assert ws in exc.value.message and "ws:1" in exc.value.message
    store.blobs.delete(K.layer_key(ws))  # now the record is gone too
    with pytest.raises(NotFound, match=r"pull|rebuild") as exc:
        stack_for(store, "os:1", "ws:1")
    assert ws in exc.value.message and "ws:1" in exc.value.message
    assert stack_for(store, "os:1")[0]  # the image alone still stacks


# --------------------------------------------------------------------------- sources


def test_classify_source(tmp_path: Path) -> None:
    assert classify_source("more-itertools==10.5.0").kind == "pypi"
    assert classify_source("requests[socks]>=2,<3").kind == "pypi"
    s = classify_source("https://github.example/o/r.git@v1.0")
    assert (s.kind, s.location, s.rev) == ("git", "https://github.example/o/r.git", "v1.0")
    s = classify_source("git@github.example:o/r.git@feature/x")
    assert (s.kind, s.location, s.rev) == ("git", "git@github.example:o/r.git", "feature/x")
    s = classify_source("ssh://git@host.example/o/r")
    assert (s.kind, s.location, s.rev) == ("git", "ssh://git@host.example/o/r", None)
    assert classify_source("git+https://host.example/r").location == "https://host.example/r"
    (tmp_path / "plain").mkdir()
    assert classify_source(str(tmp_path / "plain")).kind == "dir"
    with pytest.raises(NotFound):
        classify_source(str(tmp_path / "missing-1.0.tar.gz"))
    with pytest.raises(InvalidArgument, match="PyPI requirement"):
        classify_source("not a source!")


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


@pytest.mark.parametrize(
    ("name", "kind", "link", "match"),
    [
        ("../evil", tarfile.REGTYPE, "", "outside"),
        ("/etc/evil", tarfile.REGTYPE, "", "outside"),
        ("pkg/link", tarfile.SYMTYPE, "../../etc", "leaves the target"),
        ("pkg/abs", tarfile.SYMTYPE, "/etc/passwd", "leaves the target"),
        ("pkg/dev", tarfile.CHRTYPE, "", "device"),
        ("pkg/fifo", tarfile.FIFOTYPE, "", "FIFO"),
    ],
)
def test_extract_refuses_unsafe_members(
    tmp_path: Path, name: str, kind: bytes, link: str, match: str
) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    archive = _tar(tmp_path / "bad.tar.gz", [(info, b"x" if kind == tarfile.REGTYPE else None)])
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(InvalidArgument, match=match):
        extract_archive(archive, dest)
    assert not (tmp_path / "evil").exists()


def test_extract_refuses_symlink_chains_that_escape(tmp_path: Path) -> None:
    here = tarfile.TarInfo("a")
    here.type, here.linkname = tarfile.SYMTYPE, "."
    up = tarfile.TarInfo("a/b")  # lexically 'a/..' = '.', but 'a' is the root: really '..'
    up.type, up.linkname = tarfile.SYMTYPE, ".."
    payload = tarfile.TarInfo("a/b/x")
    archive = _tar(tmp_path / "a.tar.gz", [(here, None), (up, None), (payload, b"x")])
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(InvalidArgument, match="leaves the target"):
        extract_archive(archive, dest)
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- root: EROFS


def make_sdist(path: Path) -> Path:
    members = []
    for name, data, mode in [
        ("demo-1.0/", None, 0o775),
        ("demo-1.0/setup.py", b"from setuptools import setup\nsetup(name='demo')\n", 0o664),
        ("demo-1.0/demo/__init__.py", b"VALUE = 42\n", 0o644),
        ("demo-1.0/run.sh", b"#!/bin/sh\necho hi\n", 0o4775),
    ]:
        info = tarfile.TarInfo(name)
        info.mode, info.uid, info.gid, info.uname = mode, 1000, 1000, "someone"
        if data is None:
            info.type = tarfile.DIRTYPE
        members.append((info, data))
    return _tar(path, members)


@pytest.mark.root
@root_only
@has_mkfs
def test_build_from_directory_with_busybox_mounts_and_reads_back(
    store: ImageStore, tmp_path: Path, mount_stored: MountStored
) -> None:
    busybox = Path(shutil.which("busybox") or "/bin/busybox")
    if not busybox.is_file():
        pytest.skip("busybox-static is not installed")
    tree = tmp_path / "tree"
    (tree / "bin").mkdir(parents=True)
    (tree / "etc").mkdir()
    shutil.copy2(busybox, tree / "bin" / "busybox")
    (tree / "bin" / "sh").symlink_to("busybox")
    (tree / "etc" / "motd").write_text("hello from erofs\n")
    os.chown(tree / "etc" / "motd", 1234, 5678)
    os.chmod(tree / "etc" / "motd", 0o640)

    m = build_from_directory(store, "busybox:1", tree, log=lambda _: None)
    assert (m.ref, m.kind, len(m.layers)) == ("busybox:1", "base", 1)
    record = store.layer_record(m.layers[0].digest)
    assert store.meta_path(record).stat().st_size + record.blob_size == m.layers[0].size
    assert store.has_data(record) and record.blob_size > 0  # the file data is in chunks,
    assert store.meta_path(record).stat().st_size < busybox.stat().st_size  # not in the metadata

    mp = mount_stored(store, m.layers[0].digest)
    assert (mp / "etc" / "motd").read_text() == "hello from erofs\n"
    st = (mp / "etc" / "motd").stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1234, 5678, 0o640)
    assert os.readlink(mp / "bin" / "sh") == "busybox"
    out = subprocess.run([mp / "bin" / "busybox", "cat", mp / "etc" / "motd"], capture_output=True)
    assert out.stdout == b"hello from erofs\n"
    assert (mp / "bin" / "busybox").read_bytes() == busybox.read_bytes()
    assert list(store.tmp_dir.iterdir()) == []


@pytest.mark.root
@root_only
@has_mkfs
def test_same_tree_twice_is_one_layer(store: ImageStore, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "d").mkdir(parents=True)
    (tree / "d" / "f").write_text("content")
    a = build_from_directory(store, "a", tree, log=lambda _: None)
    time.sleep(1.1)  # a later build time must not change the bytes
    os.utime(tree / "d" / "f")
    b = build_from_directory(store, "b", tree, log=lambda _: None)
    assert a.layers[0].digest == b.layers[0].digest
    assert len(store_keys(store, "layers/")) == len(store_keys(store, "metas/")) == 1
    assert {m.ref for m in store.list()} == {"a:latest", "b:latest"}


@pytest.mark.root
@root_only
@has_mkfs
def test_split_layer_mounts_with_its_blob_and_reads_back_byte_for_byte(
    tmp_path: Path, mount_layer: MountLayer
) -> None:
    tree = tmp_path / "tree"
    (tree / "d" / "e").mkdir(parents=True)
    block = os.urandom(64 << 10)
    files = {
        "big": os.urandom((3 << 20) + 123),  # not a whole number of chunks
        "d/repeats": block * 8,  # one 64 KiB chunk eight times: stored once in the blob
        "d/e/small": b"small\n",
        "empty": b"",
    }
    for name, data in files.items():
        (tree / name).write_bytes(data)
    os.link(tree / "big", tree / "d" / "hardlink")
    (tree / "link").symlink_to("d/e/small")
    os.chown(tree / "d" / "e" / "small", 1234, 5678)
    os.chmod(tree / "d" / "e" / "small", 0o640)
    meta, blob = tmp_path / "layer.erofs", tmp_path / "layer.blob"
    assert pack_erofs(tree, meta, blob_file=blob) == meta
    assert meta.stat().st_size < 64 << 10  # metadata only: no file data in it
    data_size = len(files["big"]) + len(block)
    assert data_size <= blob.stat().st_size < data_size + (64 << 10)
    # The same tree packs to the same two files.
    meta2, blob2 = tmp_path / "again.erofs", tmp_path / "again.blob"
    pack_erofs(tree, meta2, blob_file=blob2)
    assert meta2.read_bytes() == meta.read_bytes() and blob2.read_bytes() == blob.read_bytes()

    mp = mount_layer(meta, blob)
    for name, data in files.items():
        assert (mp / name).read_bytes() == data, name
    assert (mp / "d" / "hardlink").stat().st_ino == (mp / "big").stat().st_ino
    assert os.readlink(mp / "link") == "d/e/small"
    st = (mp / "d" / "e" / "small").stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1234, 5678, 0o640)
    found = sorted(str(p.relative_to(mp)) for p in mp.rglob("*"))
    assert found == ["big", "d", "d/e", "d/e/small", "d/hardlink", "d/repeats", "empty", "link"]


@pytest.mark.root
@root_only
@has_mkfs
def test_layers_sharing_a_big_file_store_its_chunks_once(
    store: ImageStore, tmp_path: Path, mount_stored: MountStored
) -> None:
    big = os.urandom(4 << 20)
    layers = []
    for name in ("one", "two"):
        tree = tmp_path / name
        (tree / "opt").mkdir(parents=True)
        (tree / "opt" / "big").write_bytes(big)
        (tree / "opt" / f"z-{name}").write_bytes(os.urandom(100_000))  # data after the big file
        m = build_from_directory(store, f"share/{name}:1", tree, log=lambda _: None)
        layers.append(m.layers[0].digest)
    r1, r2 = (store.layer_record(d) for d in layers)
    assert layers[0] != layers[1]
    shared = set(r1.chunks) & set(r2.chunks)
    assert len(shared) >= 3, "the big file's whole chunks are the same in both layers"
    chunk_keys = store_keys(store, "chunks/")
    assert chunk_keys == sorted(K.chunk_key(c) for c in set(r1.chunks) | set(r2.chunks))
    stored = sum(store.blobs.path(k).stat().st_size for k in chunk_keys)
    assert stored <= r1.blob_size + r2.blob_size - len(shared) * r1.chunk_size
    for name, digest in zip(("one", "two"), layers, strict=True):
        mp = mount_stored(store, digest)
        assert (mp / "opt" / "big").read_bytes() == big
        assert (mp / "opt" / f"z-{name}").read_bytes() == (
            tmp_path / name / "opt" / f"z-{name}"
        ).read_bytes()


@pytest.mark.root
@root_only
@has_mkfs
def test_workspace_from_local_sdist(
    store: ImageStore, tmp_path: Path, mount_stored: MountStored
) -> None:
    sdist = make_sdist(tmp_path / "demo-1.0.tar.gz")
    m = build_workspace(store, "ws/demo:1.0", str(sdist), log=lambda _: None)
    assert m.kind == "workspace" and m.config.workdir == "/workspace"
    mp = mount_stored(store, m.layers[0].digest)
    assert sorted(p.name for p in mp.iterdir()) == ["workspace"]
    ws = mp / "workspace"
    assert sorted(p.name for p in ws.iterdir()) == ["demo", "run.sh", "setup.py"]
    assert (ws / "demo" / "__init__.py").read_text() == "VALUE = 42\n"
    st = (ws / "run.sh").stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, 0o755)  # setuid dropped
    assert {(p.stat().st_uid, p.stat().st_gid) for p in ws.rglob("*")} == {(0, 0)}


@pytest.mark.root
@root_only
@has_mkfs
def test_workspace_from_local_git_repo_at_rev(
    store: ImageStore, tmp_path: Path, mount_stored: MountStored
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.org"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "README").write_text("v1\n")
    subprocess.run([*git, "add", "README"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    first = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True)
    (repo / "README").write_text("v2\n")
    (repo / "src").mkdir()
    (repo / "src" / "x.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "two"], check=True)
    (repo / "uncommitted.txt").write_text("not in the image")

    head = build_workspace(store, "repo:head", str(repo), log=lambda _: None)
    old = build_workspace(store, "repo:v1", f"{repo}@{first.stdout.strip()}", log=lambda _: None)
    assert first.stdout.strip() in old.source

    ws = mount_stored(store, head.layers[0].digest) / "workspace"
    assert (ws / "README").read_text() == "v2\n"
    assert (ws / "src" / "x.py").read_text() == "x = 1\n"
    assert (ws / ".git").is_dir() and not (ws / "uncommitted.txt").exists()
    ws_old = mount_stored(store, old.layers[0].digest) / "workspace"
    assert (ws_old / "README").read_text() == "v1\n" and not (ws_old / "src").exists()


@pytest.mark.root
@root_only
@has_mkfs
def test_failing_mkfs_leaves_no_temp_files(store: ImageStore, tmp_path: Path) -> None:
    not_a_dir = _write(tmp_path / "file", b"x")
    with pytest.raises(Internal, match=r"mkfs\.erofs failed .*not a directory"):
        build_from_directory(store, "bad", not_a_dir, log=lambda _: None)
    assert list(store.tmp_dir.iterdir()) == []
    assert all_objects(store) == [] and store.list() == []

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(Internal, match="root of the filesystem is not a directory"):
        pack_erofs(not_a_dir, out_dir / "x.erofs")
    assert list(out_dir.iterdir()) == []
    with pytest.raises(Internal, match="root of the filesystem is not a directory"):
        pack_erofs(not_a_dir, out_dir / "x.erofs", blob_file=out_dir / "x.blob")
    assert list(out_dir.iterdir()) == []  # no metadata image, no blob
    with pytest.raises(NotFound):
        build_from_directory(store, "bad", tmp_path / "missing", log=lambda _: None)


@pytest.mark.slow
@pytest.mark.root
@root_only
@has_mkfs
@pytest.mark.timeout(900)
def test_debootstrap_bookworm_with_python3(store: ImageStore, mount_stored: MountStored) -> None:
    if shutil.which("debootstrap") is None:
        pytest.skip("debootstrap is not installed")
    lines: list[str] = []
    m = build_debootstrap(store, "debian/bookworm:py3", ["python3"], log=lines.append)
    assert any("debootstrap done" in line for line in lines)
    assert m.config.workdir == "/root" and m.config.env["LANG"] == "C.UTF-8"
    assert mounts.mounts_under(store.root) == []
    assert list(store.tmp_dir.iterdir()) == []
    root = mount_stored(store, m.layers[0].digest)
    assert (root / "usr" / "bin" / "python3").exists()
    # mtimes are kept so the .pyc files Debian compiled stay valid
    (os_py,) = root.glob("usr/lib/python3.*/os.py")
    assert os_py.stat().st_mtime > 0
    assert list((root / "var" / "cache" / "apt" / "archives").glob("*.deb")) == []
    assert list((root / "var" / "lib" / "apt" / "lists").iterdir()) == []
    for d in ("proc", "sys", "dev", "tmp", "root"):
        assert (root / d).is_dir()


def test_image_rm_then_gc_deletes_only_what_no_image_uses(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from sandfleet.cli import images as _registers_image  # noqa: F401 - the `image` group
    from sandfleet.cli.main import cli
    from sandfleet.images import build_busybox

    store = ImageStore(tmp_path / "images")
    kept = build_busybox(store, "test/kept:1", log=lambda _: None)
    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "only-here").write_text("x")
    gone = build_from_directory(store, "test/gone:1", tree, log=lambda _: None)
    args = ["--images-dir", str(store.root), "--state-dir", str(tmp_path / "state")]
    kept_keys = layer_keys(store, kept.layers[0].digest)
    gone_keys = layer_keys(store, gone.layers[0].digest) - kept_keys  # chunks may be shared
    assert K.layer_key(gone.layers[0].digest) in gone_keys
    assert all_objects(store) == sorted(kept_keys | gone_keys)
    runner = CliRunner()
    removed = runner.invoke(cli, ["image", "rm", "test/gone:1", *args])
    assert removed.exit_code == 0 and "image gc" in removed.output
    assert all_objects(store) == sorted(kept_keys | gone_keys)  # a tag went, not its layer
    pruned = runner.invoke(cli, ["image", "gc", "--min-age", "0", *args])
    assert pruned.exit_code == 0, pruned.output
    named = set(
        re.findall(r"(?:layers|metas|chunks)/sha256/[0-9a-f]{64}(?:\.json)?", pruned.output)
    )
    assert named == gone_keys, pruned.output  # each object deleted is named
    assert str(len(gone_keys)) in pruned.output.splitlines()[-1]
    assert all_objects(store) == sorted(kept_keys)
    assert store.resolve("test/kept:1") == kept


@pytest.mark.root
@has_mkfs
def test_a_toolkit_layer_goes_on_a_base_and_shares_its_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDFLEET_CHUNK_SIZE", str(64 << 10))
    store = ImageStore(tmp_path / "store")
    assert store.chunk_size == 64 << 10
    base_dir, tools_dir = tmp_path / "base", tmp_path / "tools"
    (base_dir / "etc").mkdir(parents=True)
    (base_dir / "etc" / "os").write_bytes(os.urandom(200_000))
    (tools_dir / "opt").mkdir(parents=True)
    (tools_dir / "opt" / "tool").write_text("tool\n")
    cfg = ImageConfig(env={"A": "1"}, workdir="/etc")
    base = build_from_directory(store, "org/base:1", base_dir, config=cfg)
    keys_before = set(store_keys(store, ""))
    tk = build_from_directory(store, "org/tk:1", tools_dir, kind="toolkit", on="org/base:1")
    assert [x.digest for x in tk.layers[:-1]] == [x.digest for x in base.layers]
    assert tk.kind == "toolkit" and tk.layers[-1].kind == "toolkit"
    assert tk.config == cfg and "on org/base:1" in tk.source  # inherited
    assert keys_before <= set(store_keys(store, ""))  # the base's objects untouched
    stack, _ = stack_for(store, "org/tk:1")
    assert [x.digest for x in stack] == [x.digest for x in tk.layers]
    assert store.layer_record(tk.layers[0].digest).chunk_size == 64 << 10
    with pytest.raises(NotFound):
        build_from_directory(store, "org/tk:2", tools_dir, on="org/none:1")


def test_a_bad_chunk_size_setting_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDFLEET_CHUNK_SIZE", "1000")
    with pytest.raises(InvalidArgument, match="SANDFLEET_CHUNK_SIZE"):
        ImageStore(tmp_path / "s")
    monkeypatch.setenv("SANDFLEET_CHUNK_SIZE", "lots")
    with pytest.raises(InvalidArgument, match="multiple of 4096"):
        ImageStore(tmp_path / "s")
