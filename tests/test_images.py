"""Images: refs, mirror resolution, the layer store, EROFS packing and the builders."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

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

IS_ROOT = os.geteuid() == 0
root_only = pytest.mark.skipif(not IS_ROOT, reason="needs root (EROFS mounts, chown)")
has_mkfs = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "store")


@pytest.fixture
def mount_layer(tmp_path: Path) -> Iterator[Callable[[Path], Path]]:
    """Mount an EROFS file read-only; everything is unmounted at teardown."""
    points: list[Path] = []

    def do_mount(layer: Path) -> Path:
        mp = tmp_path / f"mnt{len(points)}"
        mp.mkdir()
        mounts.mount(layer, mp, "erofs", mounts.MS_RDONLY)
        points.append(mp)
        return mp

    yield do_mount
    for mp in reversed(points):
        mounts.umount(mp, mounts.MNT_DETACH)
    assert mounts.mounts_under(tmp_path) == []


def put_image(
    store: ImageStore, ref: str, content: bytes, kind: LayerKind = "base", **cfg: Any
) -> None:
    name, tag = parse_ref(ref)
    src = _write(store.root.parent / f"{name.replace('/', '_')}-{tag}", content)
    layer = store.add_layer(src, kind)
    manifest = ImageManifest(
        name=name, tag=tag, kind=kind, layers=[layer], config=ImageConfig(**cfg)
    )
    store.put(manifest)


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
    assert store.remove("a:1").ref == "a:1"
    with pytest.raises(NotFound):
        store.resolve("a:1")
    assert store.prune() == []  # too young to prune
    assert store.prune(min_age_s=0) == [m.layers[0].digest]
    assert not store.layer_path(m.layers[0].digest).exists()
    assert store.resolve("b").layers  # still referenced, kept


def test_add_layer_dedups_and_consumes_the_file(store: ImageStore, tmp_path: Path) -> None:
    a, b = _write(tmp_path / "a", b"same"), _write(tmp_path / "b", b"same")
    da, db = store.add_layer(a, "base"), store.add_layer(b, "base")
    assert da == db and da.size == 4
    assert da.digest == "sha256:" + __import__("hashlib").sha256(b"same").hexdigest()
    assert not a.exists() and not b.exists()
    assert len(list(store.layers_dir.iterdir())) == 1
    assert list(store.tmp_dir.iterdir()) == []


def test_put_rejects_missing_layer_and_bad_digest(store: ImageStore) -> None:
    with pytest.raises(InvalidArgument, match="sha256"):
        store.layer_path("md5:abc")
    layer = {"digest": "sha256:" + "0" * 64, "size": 1, "kind": "base"}
    m = ImageManifest.model_validate({"name": "x", "tag": "1", "kind": "base", "layers": [layer]})
    with pytest.raises(NotFound, match="add_layer"):
        store.put(m)


def test_stack_for_orders_layers_and_merges_config(store: ImageStore) -> None:
    put_image(store, "os:1", b"os", env={"PATH": "/bin", "A": "1"}, workdir="/root")
    put_image(store, "ws:1", b"ws", kind="workspace", env={"A": "2"}, workdir="/workspace")
    paths, cfg = stack_for(store, "os:1", "ws:1")
    assert [p.read_bytes() for p in paths] == [b"os", b"ws"]
    assert cfg == ImageConfig(env={"PATH": "/bin", "A": "2"}, workdir="/workspace")
    paths, cfg = stack_for(store, "os:1")
    assert len(paths) == 1 and cfg.workdir == "/root"
    with pytest.raises(InvalidArgument, match="workspace"):
        stack_for(store, "ws:1")
    with pytest.raises(InvalidArgument, match="not a workspace"):
        stack_for(store, "os:1", "os:1")


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
    store: ImageStore, tmp_path: Path, mount_layer: Callable[[Path], Path]
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
    layer = store.layer_path(m.layers[0].digest)
    assert layer.stat().st_size == m.layers[0].size

    mp = mount_layer(layer)
    assert (mp / "etc" / "motd").read_text() == "hello from erofs\n"
    st = (mp / "etc" / "motd").stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1234, 5678, 0o640)
    assert os.readlink(mp / "bin" / "sh") == "busybox"
    out = subprocess.run([mp / "bin" / "busybox", "cat", mp / "etc" / "motd"], capture_output=True)
    assert out.stdout == b"hello from erofs\n"
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
    assert len(list(store.layers_dir.iterdir())) == 1
    assert {m.ref for m in store.list()} == {"a:latest", "b:latest"}


@pytest.mark.root
@root_only
@has_mkfs
def test_workspace_from_local_sdist(
    store: ImageStore, tmp_path: Path, mount_layer: Callable[[Path], Path]
) -> None:
    sdist = make_sdist(tmp_path / "demo-1.0.tar.gz")
    m = build_workspace(store, "ws/demo:1.0", str(sdist), log=lambda _: None)
    assert m.kind == "workspace" and m.config.workdir == "/workspace"
    mp = mount_layer(store.layer_path(m.layers[0].digest))
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
    store: ImageStore, tmp_path: Path, mount_layer: Callable[[Path], Path]
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

    ws = mount_layer(store.layer_path(head.layers[0].digest)) / "workspace"
    assert (ws / "README").read_text() == "v2\n"
    assert (ws / "src" / "x.py").read_text() == "x = 1\n"
    assert (ws / ".git").is_dir() and not (ws / "uncommitted.txt").exists()
    ws_old = mount_layer(store.layer_path(old.layers[0].digest)) / "workspace"
    assert (ws_old / "README").read_text() == "v1\n" and not (ws_old / "src").exists()


@pytest.mark.root
@root_only
@has_mkfs
def test_failing_mkfs_leaves_no_temp_files(store: ImageStore, tmp_path: Path) -> None:
    not_a_dir = _write(tmp_path / "file", b"x")
    with pytest.raises(Internal, match=r"mkfs\.erofs failed .*not a directory"):
        build_from_directory(store, "bad", not_a_dir, log=lambda _: None)
    assert list(store.tmp_dir.iterdir()) == []
    assert list(store.layers_dir.iterdir()) == [] and store.list() == []

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(Internal, match="root of the filesystem is not a directory"):
        pack_erofs(not_a_dir, out_dir / "x.erofs")
    assert list(out_dir.iterdir()) == []
    with pytest.raises(NotFound):
        build_from_directory(store, "bad", tmp_path / "missing", log=lambda _: None)


@pytest.mark.slow
@pytest.mark.root
@root_only
@has_mkfs
@pytest.mark.timeout(900)
def test_debootstrap_bookworm_with_python3(
    store: ImageStore, mount_layer: Callable[[Path], Path]
) -> None:
    if shutil.which("debootstrap") is None:
        pytest.skip("debootstrap is not installed")
    lines: list[str] = []
    m = build_debootstrap(store, "debian/bookworm:py3", ["python3"], log=lines.append)
    assert any("debootstrap done" in line for line in lines)
    assert m.config.workdir == "/root" and m.config.env["LANG"] == "C.UTF-8"
    assert mounts.mounts_under(store.root) == []
    assert list(store.tmp_dir.iterdir()) == []
    root = mount_layer(store.layer_path(m.layers[0].digest))
    assert (root / "usr" / "bin" / "python3").exists()
    # mtimes are kept so the .pyc files Debian compiled stay valid
    (os_py,) = root.glob("usr/lib/python3.*/os.py")
    assert os_py.stat().st_mtime > 0
    assert list((root / "var" / "cache" / "apt" / "archives").glob("*.deb")) == []
    assert list((root / "var" / "lib" / "apt" / "lists").iterdir()) == []
    for d in ("proc", "sys", "dev", "tmp", "root"):
        assert (root / d).is_dir()


def test_image_rm_then_prune_deletes_only_layers_no_image_uses(tmp_path: Path) -> None:
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
    runner = CliRunner()
    removed = runner.invoke(cli, ["image", "rm", "test/gone:1", *args])
    assert removed.exit_code == 0 and "image prune" in removed.output
    assert store.layer_path(gone.layers[0].digest).exists()  # a tag went, not its layer
    pruned = runner.invoke(cli, ["image", "prune", "--min-age", "0", *args])
    assert pruned.exit_code == 0, pruned.output
    assert "1 unused layers deleted" in pruned.output
    assert not store.layer_path(gone.layers[0].digest).exists()
    assert store.layer_path(kept.layers[0].digest).exists()
