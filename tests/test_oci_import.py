"""Importing OCI image layouts and ``docker save`` archives, without a Docker daemon.

Archives are built here with :mod:`tarfile` from a busybox tree: layer 1 holds
busybox, ``/etc/data/{a,b}`` and ``/opt/x/{old1,old2}``; layer 2 deletes
``/etc/data/a`` (whiteout), makes ``/opt/x`` opaque with only ``new``, and adds
a file with an xattr, a hard link, a symlink, a FIFO and a device node. Each
format is imported and booted as a real container sandbox; malicious and
malformed inputs must fail with a clear error, write nothing outside the
layer's tree, and leave the store's ``tmp/`` empty.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import secrets
import shutil
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from sandfleet.cli.local import LocalDeployment
from sandfleet.images import ImageStore, busybox_tree, import_image
from sandfleet.images.oci import _Applier, host_platform
from sandfleet.sdk import Client
from sandfleet.wire.errors import DataLoss, InvalidArgument, NotFound
from sandfleet.wire.models import ImageManifest
from tests.conftest import assert_clean

pytestmark = pytest.mark.root

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
B_MTIME = 1_000_000_000
ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "GREETING": "hi there"}


def _quiet(_: str) -> None:
    pass


# --------------------------------------------------------------------------- building archives


def _info(name: str, kind: bytes = tarfile.REGTYPE, **kw: Any) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.mode = kw.pop("mode", 0o755 if kind == tarfile.DIRTYPE else 0o644)
    ti.mtime = kw.pop("mtime", 1_600_000_000)
    for key, value in kw.items():
        setattr(ti, key, value)
    return ti


def _tar(entries: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for ti, data in entries:
            if data is not None:
                ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _file(name: str, data: bytes = b"", **kw: Any) -> tuple[tarfile.TarInfo, bytes]:
    return _info(name, **kw), data


def _dir(name: str, **kw: Any) -> tuple[tarfile.TarInfo, None]:
    return _info(name, tarfile.DIRTYPE, **kw), None


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, None]:
    return _info(name, kind, linkname=target, mode=0o777), None


def _layer1(tmp: Path) -> bytes:
    """busybox plus the files layer 2 changes, as `docker save` would tar a tree (./ names)."""
    tree = tmp / "layer1-tree"
    busybox_tree(tree)
    (tree / "etc" / "data").mkdir()
    (tree / "etc" / "data" / "a").write_text("a-content")
    (tree / "etc" / "data" / "b").write_text("b-content")
    os.utime(tree / "etc" / "data" / "b", (B_MTIME, B_MTIME))
    (tree / "opt" / "x").mkdir(parents=True)
    for name in ("old1", "old2"):
        (tree / "opt" / "x" / name).write_text(name)
    suid = tree / "opt" / "suid"
    suid.write_text("#!/bin/sh\n")
    os.chown(suid, 1234, 5678)
    suid.chmod(0o4755)
    os.utime(suid, (B_MTIME, B_MTIME))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(tree, arcname=".")
    shutil.rmtree(tree)
    return buf.getvalue()


def _layer2(platform: str = "amd64") -> bytes:
    noted = _info("srv/noted", pax_headers={"SCHILY.xattr.user.note": "hello"})
    return _tar(
        [
            _dir("etc/data/"),  # etc/ itself is left implicit
            _file("etc/data/.wh.a"),
            _dir("opt/x/"),
            _file("opt/x/.wh..wh..opq"),
            _file("opt/x/new", b"new"),
            _dir("srv/"),
            (noted, b"noted"),
            _link("srv/hard", "srv/noted", tarfile.LNKTYPE),
            _link("srv/link", "/etc/data/b"),
            (_info("srv/fifo", tarfile.FIFOTYPE), None),
            (_info("srv/null", tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666), None),
            _dir("work/"),
            _file("etc/platform", platform.encode()),
        ]
    )


def _config(layers: list[bytes], arch: str = "amd64") -> bytes:
    return json.dumps(
        {
            "architecture": arch,
            "os": "linux",
            "config": {
                "Env": [f"{k}={v}" for k, v in ENV.items()],
                "WorkingDir": "/work",
                "Cmd": ["/bin/sh"],
            },
            "rootfs": {
                "type": "layers",
                "diff_ids": [f"sha256:{hashlib.sha256(x).hexdigest()}" for x in layers],
            },
        }
    ).encode()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _docker_save_old(path: Path, layers: list[bytes], config: bytes | None = None) -> Path:
    """The format of Docker before 25: ``<id>/layer.tar``, ``<config hex>.json``."""
    config = _config(layers) if config is None else config
    entries: list[tuple[tarfile.TarInfo, bytes | None]] = []
    names = []
    for i, layer in enumerate(layers):
        layer_id = _sha(f"v1-id-{i}".encode())
        entries += [
            _dir(f"{layer_id}/"),
            _file(f"{layer_id}/VERSION", b"1.0"),
            _file(f"{layer_id}/json", json.dumps({"id": layer_id}).encode()),
            _file(f"{layer_id}/layer.tar", layer),
        ]
        names.append(f"{layer_id}/layer.tar")
    manifest = [{"Config": f"{_sha(config)}.json", "RepoTags": ["test:1"], "Layers": names}]
    entries += [
        _file(f"{_sha(config)}.json", config),
        _file("manifest.json", json.dumps(manifest).encode()),
        _file("repositories", b'{"test":{"1":"x"}}'),
    ]
    path.write_bytes(_tar(entries))
    return path


def _blob(root: Path, data: bytes) -> dict[str, Any]:
    (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / "sha256" / _sha(data)).write_bytes(data)
    return {"digest": f"sha256:{_sha(data)}", "size": len(data)}


def _image_manifest(root: Path, layers: list[bytes], config: bytes, gz: bool) -> bytes:
    blobs = [gzip.compress(x, mtime=0) if gz else x for x in layers]
    suffix = "+gzip" if gz else ""
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, **_blob(root, config)},
            "layers": [
                {"mediaType": f"application/vnd.oci.image.layer.v1.tar{suffix}", **_blob(root, b)}
                for b in blobs
            ],
        }
    ).encode()


def _docker_save_new(path: Path, layers: list[bytes], gz: bool) -> Path:
    """The format of Docker 25 and later: OCI blobs, plus manifest.json naming them."""
    root = path.with_suffix(".d")
    config = _config(layers)
    manifest = _image_manifest(root, layers, config, gz)
    index = {
        "schemaVersion": 2,
        "manifests": [{"mediaType": OCI_MANIFEST, **_blob(root, manifest)}],
    }
    (root / "index.json").write_text(json.dumps(index))
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    layer_names = [
        f"blobs/sha256/{d['digest'].split(':')[1]}" for d in json.loads(manifest)["layers"]
    ]
    entry = {"Config": f"blobs/sha256/{_sha(config)}", "RepoTags": ["t:1"], "Layers": layer_names}
    (root / "manifest.json").write_text(json.dumps([entry]))
    with tarfile.open(path, "w") as tar:
        for name in sorted(os.listdir(root)):
            tar.add(root / name, arcname=name)
    shutil.rmtree(root)
    return path


def _oci_layout(
    root: Path, layers: list[bytes], *, gz: bool = False, platforms: tuple[str, ...] = ("amd64",)
) -> Path:
    """An OCI layout whose index.json points to a nested index of one image per platform."""
    descs = []
    for arch in platforms:
        arch_layers = [*layers[:-1], _layer2(arch)] if arch != "amd64" else layers
        config = _config(arch_layers, arch)
        manifest = _image_manifest(root, arch_layers, config, gz)
        platform = {"os": "linux", "architecture": arch}
        descs.append({"mediaType": OCI_MANIFEST, **_blob(root, manifest), "platform": platform})
    attestation = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "layers": []})
    descs.append(
        {
            "mediaType": OCI_MANIFEST,
            **_blob(root, attestation.encode()),
            "platform": {"os": "unknown", "architecture": "unknown"},
            "annotations": {"vnd.docker.reference.type": "attestation-manifest"},
        }
    )
    nested = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": descs})
    top = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": OCI_INDEX,
                **_blob(root, nested.encode()),
                "annotations": {"org.opencontainers.image.ref.name": "1"},
            }
        ],
    }
    (root / "index.json").write_text(json.dumps(top))
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return root


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def layers(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    return [_layer1(tmp_path_factory.mktemp("layer1")), _layer2()]


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("oci-images")


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory, store_root: Path) -> Iterator[LocalDeployment]:
    state = tmp_path_factory.mktemp("oci-state")
    with LocalDeployment(state, store_root) as d:
        yield d
    assert_clean(d.state_dir)


@pytest.fixture
def client(dep: LocalDeployment) -> Iterator[Client]:
    with Client(dep.url, timeout_s=120) as c:
        yield c


def _check_in_sandbox(client: Client, manifest: ImageManifest) -> None:
    """Boot the imported image and check every change of layer 2 and the config took effect."""
    assert len(manifest.layers) == 2
    assert manifest.config.env == ENV and manifest.config.workdir == "/work"
    with client.create(image=manifest.ref) as sb:
        script = (
            'pwd; echo "$GREETING"; ls -A /etc/data; ls -A /opt/x; cat /opt/x/new; echo;'
            " cat /etc/platform; echo; readlink /srv/link; cat /srv/link; echo;"
            " stat -c '%a %u:%g %Y' /opt/suid /etc/data/b; stat -c %F /srv/fifo;"
            " stat -c '%F %t,%T' /srv/null; stat -c %i /srv/noted /srv/hard | uniq | wc -l;"
            " cat /srv/hard; echo; test -e /etc/data/a || echo a-gone; /bin/busybox true && echo ok"
        )
        r = sb.exec(["/bin/sh", "-c", script])
        assert r.ok, r
        assert r.stdout_text.splitlines() == [
            "/work",
            "hi there",
            "b",
            "new",
            "new",
            "amd64",
            "/etc/data/b",
            "b-content",
            f"4755 1234:5678 {B_MTIME}",
            f"644 0:0 {B_MTIME}",
            "fifo",
            "character special file 1,3",
            "1",  # one inode: the hard link survived packing
            "noted",
            "a-gone",
            "ok",
        ]
        assert [e.name for e in sb.files.list("/etc/data")] == ["b"]
        assert sb.files.stat("/etc/data/b").mtime == B_MTIME
        assert sorted(e.name for e in sb.files.list("/opt/x")) == ["new"]
        sb.files.write("/etc/data/c", b"c")  # the writable layer still works on top
        assert sb.exec("ls /etc/data").stdout == b"b\nc\n"


def _assert_store_clean(store: ImageStore) -> None:
    assert list(store.tmp_dir.iterdir()) == []


# --------------------------------------------------------------------------- imports that work


def test_docker_save_old_form_boots_as_a_sandbox(
    client: Client, store_root: Path, layers: list[bytes], tmp_path: Path
) -> None:
    store = ImageStore(store_root)
    archive = _docker_save_old(tmp_path / "old.tar", layers)
    manifest = import_image(store, "imported/old:1", archive, log=_quiet)
    assert manifest.source == f"docker-save:{archive}"
    assert store.resolve("imported/old:1") == manifest
    _assert_store_clean(store)
    _check_in_sandbox(client, manifest)


def test_docker_save_oci_form_with_gzip_layers(
    client: Client, store_root: Path, layers: list[bytes], tmp_path: Path
) -> None:
    store = ImageStore(store_root)
    archive = _docker_save_new(tmp_path / "new.tar", layers, gz=True)
    lines: list[str] = []
    manifest = import_image(store, "imported/new:1", archive, log=lines.append)
    assert manifest.source.startswith("docker-save:")
    assert any("applied layer 2/2" in line for line in lines)
    _assert_store_clean(store)
    _check_in_sandbox(client, manifest)
    old = import_image(store, "imported/old:2", _docker_save_old(tmp_path / "o.tar", layers))
    # the same content gives the same layers, whatever the archive's form and compression
    assert [x.digest for x in manifest.layers] == [x.digest for x in old.layers]


def test_oci_layout_picks_the_host_platform_from_a_nested_index(
    client: Client, store_root: Path, layers: list[bytes], tmp_path: Path
) -> None:
    assert host_platform() == "linux/amd64"  # the layout's amd64 image says "amd64"
    store = ImageStore(store_root)
    layout = _oci_layout(tmp_path / "layout", layers, platforms=("arm64", "amd64"))
    manifest = import_image(store, "imported/oci:1", layout, log=_quiet)
    assert manifest.source == f"oci:{layout}"
    _assert_store_clean(store)
    _check_in_sandbox(client, manifest)
    # the same layout as a tar gives the same image
    archive = tmp_path / "layout.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(layout, arcname=".")
    again = import_image(store, "imported/oci:2", archive, log=_quiet)
    assert [x.digest for x in again.layers] == [x.digest for x in manifest.layers]


def test_cli_image_import(store_root: Path, layers: list[bytes], tmp_path: Path) -> None:
    from click.testing import CliRunner

    from sandfleet.cli import images as _registers_image  # noqa: F401 - the `image` group
    from sandfleet.cli.main import cli

    layout = _oci_layout(tmp_path / "layout", layers, gz=True)
    args = ["--images-dir", str(store_root), "--state-dir", str(tmp_path / "state")]
    result = CliRunner().invoke(cli, ["image", "import", "imported/cli:1", str(layout), *args])
    assert result.exit_code == 0, result.output
    assert "imported imported/cli:1: 2 layer(s)" in result.output and "MiB" in result.output
    assert ImageStore(store_root).resolve("imported/cli:1").source == f"oci:{layout}"


def test_empty_layers_are_skipped(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    content = _tar([_dir("etc/"), _file("etc/hello", b"hi")])
    archive = _docker_save_old(tmp_path / "e.tar", [_tar([]), content, b"", _tar([_dir("./")])])
    lines: list[str] = []
    manifest = import_image(store, "imported/empty:1", archive, log=lines.append)
    assert len(manifest.layers) == 1
    assert sum("is empty: skipped" in line for line in lines) == 3
    only_empty = _docker_save_old(tmp_path / "only.tar", [_tar([])])
    with pytest.raises(InvalidArgument, match="layer\\(s\\) is empty; nothing to import"):
        import_image(store, "imported/empty:2", only_empty, log=_quiet)
    _assert_store_clean(store)


def test_layer_tree_keeps_metadata_and_converts_whiteouts(tmp_path: Path) -> None:
    """What one layer's tree holds before packing: overlayfs's forms and every kind of file."""
    tree = tmp_path / "tree"
    tree.mkdir()
    data = _layer2()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tar:
        assert _Applier(tree, "test", _quiet).apply(tar) == 13
    wh = os.lstat(tree / "etc" / "data" / "a")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0
    assert os.getxattr(tree / "opt" / "x", "trusted.overlay.opaque") == b"y"
    assert os.listdir(tree / "opt" / "x") == ["new"]
    assert os.getxattr(tree / "srv" / "noted", "user.note") == b"hello"
    assert os.stat(tree / "srv" / "hard").st_ino == os.stat(tree / "srv" / "noted").st_ino
    assert os.readlink(tree / "srv" / "link") == "/etc/data/b"
    assert stat.S_ISFIFO(os.lstat(tree / "srv" / "fifo").st_mode)
    null = os.lstat(tree / "srv" / "null")
    assert stat.S_ISCHR(null.st_mode) and null.st_rdev == os.makedev(1, 3)
    assert stat.S_IMODE(null.st_mode) == 0o666
    assert os.stat(tree / "srv").st_mtime == 1_600_000_000  # set after its entries were made
    assert os.stat(tree / "etc").st_mtime == 0  # implicit parent: fixed, for reproducibility
    assert stat.S_IMODE(os.stat(tree / "etc").st_mode) == 0o755


def test_same_layer_entry_wins_over_its_whiteout_and_later_entries_replace(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    data = _tar(
        [
            _file("kept"),
            _file(".wh.kept"),  # a whiteout hides lower layers only: the file stays
            _file(".wh.gone-then-dir"),
            _file("gone-then-dir/inside", b"x"),  # recreated in the layer: opaque dir
            _file("twice", b"1"),
            _file("twice", b"2", mode=0o600),
            _dir("dir-then-file/"),
            _file("dir-then-file/x"),
            _file("dir-then-file", b"f"),
            _file(".wh..wh.plnk"),  # AUFS's own bookkeeping: ignored
        ]
    )
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tar:
        _Applier(tree, "test", _quiet).apply(tar)
    assert (tree / "kept").is_file() and not stat.S_ISCHR(os.lstat(tree / "kept").st_mode)
    assert os.getxattr(tree / "gone-then-dir", "trusted.overlay.opaque") == b"y"
    assert (tree / "gone-then-dir" / "inside").read_bytes() == b"x"
    assert (tree / "twice").read_bytes() == b"2"
    assert stat.S_IMODE(os.stat(tree / "twice").st_mode) == 0o600
    assert (tree / "dir-then-file").read_bytes() == b"f"
    assert sorted(os.listdir(tree)) == ["dir-then-file", "gone-then-dir", "kept", "twice"]


# --------------------------------------------------------------------------- inputs refused


def _bad_layer_archive(tmp_path: Path, entries: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    return _docker_save_old(tmp_path / "bad.tar", [_tar(entries)])


@pytest.mark.parametrize(
    ("entries", "says"),
    [
        ([_file("../../escape", b"x")], "'../../escape'"),
        ([_file("ok/../../../escape", b"x")], "contains '..'"),
        ([_file("/abs-escape", b"x")], "'/abs-escape'"),
        ([_link("h", "../../../etc/passwd", tarfile.LNKTYPE)], "'../../../etc/passwd'"),
        ([_link("h", "/etc/passwd", tarfile.LNKTYPE)], "'/etc/passwd'"),
        ([_link("h", "nothing-here", tarfile.LNKTYPE)], "not a file earlier in this layer"),
        ([_link("d", "/tmp"), _file("d/pwned-{token}", b"x")], "goes through 'd', a symlink"),
        ([_link("d", "../../.."), _file("d/pwned-{token}", b"x")], "goes through 'd'"),
        ([_link("d", "/tmp"), _dir("d/sub-{token}/")], "goes through 'd'"),
        (
            [_link("d", "/tmp"), _file("f"), _link("d/pwned-{token}", "f", tarfile.LNKTYPE)],
            "goes through 'd'",
        ),
        ([_link("d", "/tmp"), _file("d/.wh.pwned-{token}")], "goes through 'd'"),
        ([_file("f"), _file("f/under-a-file")], "needs 'f' to be a directory"),
    ],
)
def test_malicious_layers_are_refused_and_write_nothing_outside(
    tmp_path: Path, entries: list[tuple[tarfile.TarInfo, bytes | None]], says: str
) -> None:
    token = secrets.token_hex(4)
    for ti, _ in entries:
        ti.name = ti.name.replace("{token}", token)
    store = ImageStore(tmp_path / "images")
    archive = _bad_layer_archive(tmp_path, entries)
    with pytest.raises(InvalidArgument) as exc:
        import_image(store, "bad/layer:1", archive, log=_quiet)
    assert says in str(exc.value)
    assert not Path(f"/tmp/pwned-{token}").exists() and not Path(f"/tmp/sub-{token}").exists()
    assert not Path(f"/pwned-{token}").exists() and not Path("/abs-escape").exists()
    assert not (store.root / "escape").exists() and not (store.tmp_dir / "escape").exists()
    assert not (store.root.parent / "escape").exists()
    _assert_store_clean(store)
    assert store.list() == []


def _corrupt_oci(tmp_path: Path, layers: list[bytes]) -> Path:
    layout = _oci_layout(tmp_path / "layout", layers)

    def blob(digest: str) -> Path:
        return layout / "blobs" / "sha256" / digest.split(":")[1]

    top = json.loads((layout / "index.json").read_text())
    nested = json.loads(blob(top["manifests"][0]["digest"]).read_text())
    manifest = json.loads(blob(nested["manifests"][0]["digest"]).read_text())
    layer = blob(manifest["layers"][1]["digest"])
    content = bytearray(layer.read_bytes())
    content[-1] ^= 0x01  # in the end-of-archive padding: still a readable tar, but changed
    layer.write_bytes(bytes(content))
    return layout


def _missing_layer(tmp_path: Path, layers: list[bytes]) -> Path:
    archive = _docker_save_old(tmp_path / "full.tar", layers)
    out = tmp_path / "missing.tar"
    with tarfile.open(archive) as src, tarfile.open(out, "w") as dst:
        for m in src.getmembers():
            if not (m.name.endswith("layer.tar") and m.name.startswith(_sha(b"v1-id-1"))):
                dst.addfile(m, src.extractfile(m) if m.isfile() else None)
    return out


def _bad_diff_id(tmp_path: Path, layers: list[bytes]) -> Path:
    config = json.loads(_config(layers))
    config["rootfs"]["diff_ids"][0] = f"sha256:{'0' * 64}"
    return _docker_save_old(tmp_path / "diff.tar", layers, json.dumps(config).encode())


def _zstd_layer(tmp_path: Path, layers: list[bytes]) -> Path:
    return _docker_save_old(tmp_path / "z.tar", [b"\x28\xb5\x2f\xfd" + b"\0" * 100])


def _two_images(tmp_path: Path, layers: list[bytes]) -> Path:
    archive = _docker_save_old(tmp_path / "one.tar", layers)
    out = tmp_path / "two.tar"
    with tarfile.open(archive) as src, tarfile.open(out, "w") as dst:
        for m in src.getmembers():
            data: IO[bytes] | None = src.extractfile(m) if m.isfile() else None
            if m.name == "manifest.json" and data is not None:
                entries = json.loads(data.read())
                raw = json.dumps([*entries, {**entries[0], "RepoTags": ["other:2"]}]).encode()
                m.size = len(raw)
                data = io.BytesIO(raw)
            dst.addfile(m, data)
    return out


def _not_archive(tmp_path: Path, layers: list[bytes]) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text("this is not an image\n" * 100)
    return path


def _tar_without_manifest(tmp_path: Path, layers: list[bytes]) -> Path:
    path = tmp_path / "plain.tar"
    path.write_bytes(_tar([_file("hello.txt", b"hi")]))
    return path


def _layer_not_a_tar(tmp_path: Path, layers: list[bytes]) -> Path:
    return _docker_save_old(tmp_path / "nt.tar", [b"hello, I am not a tar" * 50])


def _nothing_for_amd64(tmp_path: Path, layers: list[bytes]) -> Path:
    return _oci_layout(tmp_path / "layout", layers, platforms=("arm64", "s390x"))


@pytest.mark.parametrize(
    ("make", "error", "says"),
    [
        (_not_archive, InvalidArgument, "not a recognized image: expected an OCI image layout"),
        (_tar_without_manifest, InvalidArgument, "found hello.txt"),
        (_layer_not_a_tar, InvalidArgument, "layer.tar is not a readable tar"),
        (_zstd_layer, InvalidArgument, "zstd-compressed: sandfleet cannot read zstd"),
        (_two_images, InvalidArgument, "holds 2 images (test:1; other:2)"),
        (_nothing_for_amd64, InvalidArgument, "no image for linux/amd64"),
        (_corrupt_oci, DataLoss, "not sha256:"),
        (_bad_diff_id, DataLoss, "rootfs.diff_ids"),
        (_missing_layer, NotFound, f"{_sha(b'v1-id-1')}/layer.tar is missing from the archive"),
    ],
)
def test_bad_inputs_say_what_is_wrong_and_leave_nothing(
    tmp_path: Path, layers: list[bytes], make: Any, error: type[Exception], says: str
) -> None:
    store = ImageStore(tmp_path / "images")
    source = make(tmp_path, layers)
    with pytest.raises(error) as exc:
        import_image(store, "bad/input:1", source, log=_quiet)
    assert says in str(exc.value)
    if make is _nothing_for_amd64:
        assert "it has linux/arm64, linux/s390x" in str(exc.value)
    _assert_store_clean(store)
    assert store.list() == []


def test_missing_source_and_bad_ref(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    with pytest.raises(NotFound, match="does not exist"):
        import_image(store, "x/y:1", tmp_path / "nope.tar", log=_quiet)
    with pytest.raises(InvalidArgument):
        import_image(store, "Bad Ref!", tmp_path, log=_quiet)
    with pytest.raises(InvalidArgument, match="found nothing"):
        import_image(store, "x/y:1", tmp_path / "images" / "manifests", log=_quiet)
    _assert_store_clean(store)
