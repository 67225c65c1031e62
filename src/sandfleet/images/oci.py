"""Import container images without a Docker daemon: OCI image layouts and ``docker save`` archives.

Accepted, as a directory or as a tar (optionally compressed) of one:

- an OCI image layout: ``oci-layout``, ``index.json`` and ``blobs/<alg>/<hex>``;
  an index listing several images (nested indexes included) is resolved to the
  one for this host's platform (``linux/amd64`` on x86-64);
- a ``docker save`` archive: ``manifest.json`` naming ``Config``, ``RepoTags``
  and ``Layers`` (``<id>/layer.tar`` in older Docker, ``blobs/sha256/<hex>`` in
  newer).

Each non-empty image layer (a tar: uncompressed, gzip, bzip2 or xz; zstd is
refused with how to convert it) is applied into a fresh tree of its own, in
the form overlayfs expects of a lower layer: an OCI whiteout ``.wh.<name>``
becomes a character device 0/0 ``<name>``, an opaque marker ``.wh..wh..opq``
the xattr ``trusted.overlay.opaque=y`` on its directory. Modes, numeric
owners, mtimes, symlinks, hard links (within the layer), device nodes, FIFOs
and PAX xattrs (``SCHILY.xattr.*``, ``LIBARCHIVE.xattr.*``) are kept;
``trusted.overlay.*`` xattrs in a layer are dropped (only whiteouts say what
to hide). The trees are packed bottom first by :func:`commit_layers`.

Layers are untrusted input. Every entry is created relative to directory file
descriptors opened with ``O_NOFOLLOW``: an absolute or ``..`` name, a hard
link to such a name, and an entry whose parent is a symlink are refused
(:class:`InvalidArgument` naming the entry), so nothing is ever written
outside the layer's tree and no symlink is ever followed. Every blob whose
digest is known (OCI descriptors, ``blobs/sha256/<hex>`` names) is verified,
and each layer's uncompressed content against the config's
``rootfs.diff_ids``: a mismatch is :class:`DataLoss`.
"""

from __future__ import annotations

import base64
import binascii
import bz2
import contextlib
import errno
import gzip
import hashlib
import json
import lzma
import os
import platform
import posixpath
import re
import shutil
import stat
import tarfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO, Protocol, cast
from urllib.parse import unquote

from sandfleet.wire.errors import (
    DataLoss,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SandfleetError,
)
from sandfleet.wire.models import ImageConfig, ImageManifest

from .build import Log, commit_layers, stderr_log
from .refs import parse_ref
from .store import ImageStore

__all__ = ["host_platform", "import_image"]

_EXPECTED = (
    "expected an OCI image layout (oci-layout, index.json, blobs/sha256/...) or a "
    "`docker save` archive (manifest.json), as a directory or a tar of one"
)
_INDEX_TYPES = frozenset(
    {
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
    }
)
_MANIFEST_TYPES = frozenset(
    {
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    }
)
_DIGEST_RE = re.compile(r"(sha256|sha512):([0-9a-f]{64}|[0-9a-f]{128})")
_BLOB_NAME_RE = re.compile(r"(?:\./)?blobs/(sha256|sha512)/([0-9a-f]{64}|[0-9a-f]{128})")
_OLD_CONFIG_RE = re.compile(r"(?:\./)?([0-9a-f]{64})\.json")
_MAGIC = (
    (b"\x1f\x8b", "gzip"),
    (b"BZh", "bzip2"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
)
_ZSTD_HINT = (
    "sandfleet cannot read zstd-compressed layers; convert the image to gzip first, e.g. "
    "`skopeo copy --dest-compress-format gzip oci:IN oci:OUT` (or `docker save`, which "
    "writes uncompressed layers)"
)
_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
_MAX_JSON = 16 << 20
_CHUNK = 1 << 20
_MAX_NESTING = 8
_WH = ".wh."
_OPAQUE = ".wh..wh..opq"
_OPAQUE_XATTR = "trusted.overlay.opaque"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def host_platform() -> str:
    """This host's platform as OCI writes it: ``linux/amd64`` on x86-64, ``linux/arm64``, ..."""
    machine = platform.machine().lower()
    return f"linux/{_ARCH.get(machine, machine)}"


def import_image(
    store: ImageStore, ref: str, source: Path, *, log: Log = stderr_log
) -> ImageManifest:
    """Import the image at ``source`` into ``store`` as ``ref`` (name:tag), a layer per image layer.

    ``source`` is an OCI image layout or a ``docker save`` archive, as a
    directory or a tar; the format is detected (see the module docstring).
    The image config's ``Env`` and ``WorkingDir`` become the manifest's
    ``config``; the layers are ``base`` layers with their mtimes kept.
    Returns the stored manifest.

    Raises :class:`NotFound` if ``source``, or a file its manifest names,
    does not exist; :class:`InvalidArgument` for a bad ``ref``, an
    unrecognized source (saying what was expected), an index without an
    image for this host (listing the platforms it has), a zstd layer, or an
    unsafe or unreadable layer entry (naming it); :class:`DataLoss` when a
    blob does not match its digest; :class:`PermissionDenied` when not run as
    root. On any error nothing is stored and nothing stays in the store's
    ``tmp/``.
    """
    parse_ref(ref)
    source = Path(source)
    if not source.exists():
        raise NotFound(f"cannot import {ref}: {source} does not exist")
    with _open_source(source) as src, store.scratch(prefix="import-") as scratch:
        plan = _plan(src)
        n = len(plan.layers)
        log(f"importing {plan.kind} image {src.label}: {n} layer(s)")
        if plan.platform and plan.platform != host_platform():
            log(f"warning: the image is for {plan.platform}, this host is {host_platform()}")
        trees = []
        for i, layer in enumerate(plan.layers):
            t0 = time.monotonic()
            tree = scratch / f"tree-{i}"
            tree.mkdir()
            tree.chmod(0o755)
            entries, size = _apply_blob(src, layer, tree, log)
            if not os.listdir(tree) and not os.listxattr(tree):
                log(f"layer {i + 1}/{n} ({layer.name}) is empty: skipped")
                continue
            log(
                f"applied layer {i + 1}/{n}: {entries} entries, {size / 1e6:.1f} MB"
                f" in {time.monotonic() - t0:.1f} s"
            )
            trees.append(tree)
        if not trees:
            raise InvalidArgument(
                f"{src.label}: every one of the image's {n} layer(s) is empty; nothing to import"
            )
        return commit_layers(
            store,
            ref,
            trees,
            scratch,
            kind="base",
            config=plan.config,
            source=f"{plan.kind}:{source.resolve()}",
            preserve_mtime=True,
            log=log,
        )


# --------------------------------------------------------------------------- sources


class _Source:
    """Files of a layout or archive, by their names inside it."""

    label: str

    def exists(self, name: str) -> bool:
        raise NotImplementedError

    def open(self, name: str) -> IO[bytes]:
        raise NotImplementedError

    def top_names(self) -> list[str]:
        raise NotImplementedError


class _DirSource(_Source):
    def __init__(self, root: Path) -> None:
        self.root = root
        self.label = str(root)
        self._real = os.path.realpath(root)

    def _path(self, name: str) -> str:
        norm = posixpath.normpath(name)
        if name.startswith("/") or norm == ".." or norm.startswith("../"):
            raise InvalidArgument(f"{self.label}: the manifest names {name!r}, outside the layout")
        path = os.path.realpath(os.path.join(self._real, norm))
        if not path.startswith(self._real + os.sep):
            raise InvalidArgument(
                f"{self.label}: {name!r} leads outside the layout through a symlink"
            )
        return path

    def exists(self, name: str) -> bool:
        try:
            return os.path.isfile(self._path(name))
        except InvalidArgument:
            return False

    def open(self, name: str) -> IO[bytes]:
        path = self._path(name)
        if os.path.isdir(path):
            raise InvalidArgument(f"{self.label}: {name} is a directory, not a file")
        try:
            return open(path, "rb")
        except FileNotFoundError:
            raise NotFound(
                f"{self.label}: {name} is missing (the image's manifest refers to it)"
            ) from None

    def top_names(self) -> list[str]:
        return sorted(os.listdir(self.root))


class _TarSource(_Source):
    def __init__(self, path: Path, tar: tarfile.TarFile) -> None:
        self.label = str(path)
        self._tar = tar
        self._members = {_norm(m.name): m for m in tar.getmembers()}

    def exists(self, name: str) -> bool:
        m = self._members.get(_norm(name))
        return m is not None and not m.isdir()

    def open(self, name: str) -> IO[bytes]:
        m = self._members.get(_norm(name))
        if m is None:
            raise NotFound(
                f"{self.label}: {name} is missing from the archive "
                "(the image's manifest refers to it)"
            )
        try:
            fh = self._tar.extractfile(m)
        except KeyError:
            raise NotFound(
                f"{self.label}: {name} is a link to {m.linkname!r}, which is not in the archive"
            ) from None
        if fh is None:
            raise InvalidArgument(f"{self.label}: {name} is not a regular file")
        return fh

    def top_names(self) -> list[str]:
        return sorted({name.split("/", 1)[0] for name in self._members if name != "."})


def _norm(name: str) -> str:
    return posixpath.normpath(name).lstrip("/")


@contextlib.contextmanager
def _open_source(source: Path) -> Iterator[_Source]:
    if source.is_dir():
        yield _DirSource(source)
        return
    try:
        tar = tarfile.open(source, "r:*")  # noqa: SIM115 - closed below, after the import
    except (tarfile.TarError, OSError, EOFError, zlib.error, lzma.LZMAError) as exc:
        raise InvalidArgument(
            f"{source} is not a recognized image: {_EXPECTED}; it is neither a directory "
            f"nor a readable tar ({exc})"
        ) from None
    try:
        yield _TarSource(source, tar)
    finally:
        tar.close()


# --------------------------------------------------------------------------- manifests


@dataclass
class _Layer:
    name: str
    digest: str | None = None
    size: int | None = None
    diff_id: str | None = None
    media_type: str = ""


@dataclass
class _Plan:
    kind: str  # "oci" or "docker-save"
    layers: list[_Layer]
    config: ImageConfig = field(default_factory=ImageConfig)
    platform: str = ""  # "os/architecture" from the image config, when it says


def _plan(src: _Source) -> _Plan:
    if src.exists("manifest.json"):
        layers, config = _plan_docker(src)
        kind = "docker-save"
    elif src.exists("index.json"):
        layers, config = _plan_oci(src)
        kind = "oci"
    else:
        found = ", ".join(src.top_names()[:10]) or "nothing"
        raise InvalidArgument(f"{src.label} is not a recognized image: {_EXPECTED}; found {found}")
    diff_ids = _obj(config.get("rootfs") or {}, "rootfs of the image config", src).get("diff_ids")
    if isinstance(diff_ids, list) and len(diff_ids) == len(layers):
        for layer, diff_id in zip(layers, diff_ids, strict=True):
            if isinstance(diff_id, str) and _DIGEST_RE.fullmatch(diff_id):
                layer.diff_id = diff_id
    os_name, arch = config.get("os"), config.get("architecture")
    plat = f"{os_name}/{arch}" if isinstance(os_name, str) and isinstance(arch, str) else ""
    return _Plan(kind=kind, layers=layers, config=_image_config(config, src), platform=plat)


def _plan_docker(src: _Source) -> tuple[list[_Layer], dict[str, Any]]:
    entries = _read_json(src, "manifest.json", None, "docker save manifest")
    if not isinstance(entries, list) or not entries:
        raise InvalidArgument(f"{src.label}: manifest.json lists no image")
    if len(entries) > 1:
        tags = [
            ",".join(e.get("RepoTags") or ["<untagged>"]) if isinstance(e, dict) else "?"
            for e in entries
        ]
        raise InvalidArgument(
            f"{src.label} holds {len(entries)} images ({'; '.join(tags)}): save one image "
            "per archive (`docker save IMAGE -o FILE.tar`)"
        )
    entry = _obj(entries[0], "manifest.json entry", src)
    config_name = _str(entry.get("Config"), "Config of manifest.json", src)
    config = _obj(
        _read_json(src, config_name, _digest_of_name(config_name), "image config"),
        f"image config {config_name}",
        src,
    )
    names = entry.get("Layers")
    if not isinstance(names, list):
        raise InvalidArgument(f"{src.label}: manifest.json has no Layers list")
    layers = []
    for name in names:
        name = _str(name, "a Layers entry of manifest.json", src)
        layers.append(_Layer(name=name, digest=_digest_of_name(name)))
    return layers, config


def _digest_of_name(name: str) -> str | None:
    """The digest a ``docker save`` file name implies: ``blobs/sha256/<hex>``, ``<hex>.json``."""
    m = _BLOB_NAME_RE.fullmatch(name)
    if m:
        return f"{m.group(1)}:{m.group(2)}"
    m = _OLD_CONFIG_RE.fullmatch(name)
    return f"sha256:{m.group(1)}" if m else None


def _plan_oci(src: _Source) -> tuple[list[_Layer], dict[str, Any]]:
    index = _obj(_read_json(src, "index.json", None, "image index"), "index.json", src)
    found: list[tuple[dict[str, Any], dict[str, Any]]] = []
    _collect(src, index, "index.json", 0, found)
    if not found:
        raise InvalidArgument(f"{src.label}: index.json lists no image manifest")
    chosen = _choose(src, found)
    manifest = chosen[1]
    config_desc = _obj(manifest.get("config"), "config of the image manifest", src)
    config = _obj(_read_blob_json(src, config_desc, "image config"), "image config", src)
    descs = manifest.get("layers")
    if not isinstance(descs, list):
        raise InvalidArgument(f"{src.label}: the image manifest has no layers list")
    layers = []
    for desc in descs:
        d = _obj(desc, "a layer descriptor", src)
        digest = _descriptor_digest(src, d)
        size = d.get("size")
        layers.append(
            _Layer(
                name=_blob_name(digest),
                digest=digest,
                size=size if isinstance(size, int) else None,
                media_type=str(d.get("mediaType") or ""),
            )
        )
    return layers, config


def _collect(
    src: _Source,
    index: dict[str, Any],
    where: str,
    depth: int,
    out: list[tuple[dict[str, Any], dict[str, Any]]],
) -> None:
    """Append (descriptor, manifest) for every image manifest under ``index``, nested ones too."""
    if depth > _MAX_NESTING:
        raise InvalidArgument(f"{src.label}: indexes nested more than {_MAX_NESTING} deep")
    descs = index.get("manifests")
    if not isinstance(descs, list):
        raise InvalidArgument(f"{src.label}: {where} has no manifests list")
    for desc in descs:
        d = _obj(desc, f"a descriptor in {where}", src)
        media_type = d.get("mediaType")
        if media_type is not None and media_type not in _INDEX_TYPES | _MANIFEST_TYPES:
            continue  # an artifact (signature, SBOM, ...), not an image
        annotations = d.get("annotations") or {}
        if (
            isinstance(annotations, dict)
            and annotations.get("vnd.docker.reference.type") == "attestation-manifest"
        ):
            continue
        blob = _obj(_read_blob_json(src, d, "manifest"), f"manifest {d.get('digest')}", src)
        if media_type in _INDEX_TYPES or (media_type is None and "manifests" in blob):
            _collect(src, blob, f"index {d.get('digest')}", depth + 1, out)
        else:
            out.append((d, blob))


def _choose(
    src: _Source, found: list[tuple[dict[str, Any], dict[str, Any]]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The one image manifest for this host among ``found``."""
    if len({d.get("digest") for d, _ in found}) == 1:
        return found[0]
    want = host_platform()
    platforms = [_platform_of(src, d, m) for d, m in found]
    matching = [
        (pair, p)
        for pair, p in zip(found, platforms, strict=True)
        if "/".join(p.split("/")[:2]) == want
    ]
    if not matching:
        have = ", ".join(sorted(set(platforms)))
        raise InvalidArgument(
            f"{src.label} has no image for {want}, this host's platform: it has {have}"
        )
    if len({pair[0].get("digest") for pair, _ in matching}) > 1:
        names = [
            str((pair[0].get("annotations") or {}).get("org.opencontainers.image.ref.name", "?"))
            for pair, _ in matching
        ]
        raise InvalidArgument(
            f"{src.label} holds {len(matching)} different images for {want} (ref names: "
            f"{', '.join(names)}): copy the one to import into a layout of its own, e.g. "
            "`skopeo copy oci:DIR:NAME oci:OUT`"
        )
    return matching[0][0]


def _platform_of(src: _Source, desc: dict[str, Any], manifest: dict[str, Any]) -> str:
    plat = desc.get("platform")
    if not isinstance(plat, dict):  # not in the index: ask the image's config
        config_desc = manifest.get("config")
        plat = {}
        if isinstance(config_desc, dict):
            with contextlib.suppress(NotFound, InvalidArgument):
                cfg = _read_blob_json(src, config_desc, "image config")
                plat = cfg if isinstance(cfg, dict) else {}
    os_name, arch = plat.get("os") or "unknown", plat.get("architecture") or "unknown"
    variant = plat.get("variant")
    return f"{os_name}/{arch}" + (f"/{variant}" if variant else "")


def _descriptor_digest(src: _Source, desc: dict[str, Any]) -> str:
    digest = desc.get("digest")
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise InvalidArgument(
            f"{src.label}: descriptor digest {digest!r} is not 'sha256:<hex>' or 'sha512:<hex>'"
        )
    return digest


def _blob_name(digest: str) -> str:
    alg, _, hexdigest = digest.partition(":")
    return f"blobs/{alg}/{hexdigest}"


def _read_blob_json(src: _Source, desc: dict[str, Any], what: str) -> Any:
    digest = _descriptor_digest(src, desc)
    return _read_json(src, _blob_name(digest), digest, what)


def _read_json(src: _Source, name: str, digest: str | None, what: str) -> Any:
    with src.open(name) as fh:
        data = fh.read(_MAX_JSON + 1)
    if len(data) > _MAX_JSON:
        raise InvalidArgument(f"{src.label}: {name} ({what}) is larger than {_MAX_JSON} bytes")
    if digest is not None:
        alg, _, want = digest.partition(":")
        _verify(src, name, digest, hashlib.new(alg, data).hexdigest(), want)
    try:
        return json.loads(data)
    except ValueError as exc:
        raise InvalidArgument(f"{src.label}: {name} ({what}) is not valid JSON: {exc}") from None


def _verify(src: _Source, name: str, digest: str, got_hex: str, want_hex: str) -> None:
    if got_hex != want_hex:
        alg = digest.partition(":")[0]
        raise DataLoss(
            f"{src.label}: {name} has digest {alg}:{got_hex}, not {digest} as the image says: "
            "the file is corrupt or was changed; export the image again"
        )


def _image_config(config: dict[str, Any], src: _Source) -> ImageConfig:
    inner = _obj(config.get("config") or {}, "config of the image config", src)
    env: dict[str, str] = {}
    for item in inner.get("Env") or []:
        if isinstance(item, str) and item:
            key, _, value = item.partition("=")
            env[key] = value
    workdir = inner.get("WorkingDir")
    return ImageConfig(env=env, workdir=workdir if isinstance(workdir, str) and workdir else None)


def _obj(value: Any, what: str, src: _Source) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{src.label}: {what} is not a JSON object")
    return value


def _str(value: Any, what: str, src: _Source) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{src.label}: {what} is not a file name")
    return value


# --------------------------------------------------------------------------- layer blobs


class _Readable(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


class _HashReader:
    """A readable stream that hashes (and counts) every byte read through it; ``peek`` too."""

    def __init__(self, raw: _Readable, algorithm: str = "sha256") -> None:
        self._raw = raw
        self._head = b""
        self.hash = hashlib.new(algorithm)
        self.size = 0

    def _pull(self, n: int) -> bytes:
        data = self._raw.read(n)
        self.hash.update(data)
        self.size += len(data)
        return data

    def peek(self, n: int) -> bytes:
        while len(self._head) < n:
            more = self._pull(n - len(self._head))
            if not more:
                break
            self._head += more
        return self._head[:n]

    def read(self, n: int | None = -1) -> bytes:
        head, self._head = self._head, b""
        if n is None or n < 0:
            return head + self._pull(-1)
        if len(head) >= n:
            self._head = head[n:]
            return head[:n]
        return head + self._pull(n - len(head))

    def drain(self) -> None:
        while self.read(_CHUNK):
            pass


def _apply_blob(src: _Source, layer: _Layer, tree: Path, log: Log) -> tuple[int, int]:
    """Apply ``layer`` into ``tree``; verify its digests. Returns (entries, uncompressed bytes)."""
    where = f"{src.label}: layer {layer.name}"
    if layer.media_type.endswith("zstd"):
        raise InvalidArgument(f"{where} is zstd-compressed: {_ZSTD_HINT}")
    algorithm = (layer.digest or "sha256:").partition(":")[0]
    with src.open(layer.name) as raw:
        outer = _HashReader(raw, algorithm)
        head = outer.peek(6)
        compression = next((c for magic, c in _MAGIC if head.startswith(magic)), None)
        if compression == "zstd":
            raise InvalidArgument(f"{where} is zstd-compressed: {_ZSTD_HINT}")
        stream: _Readable = outer
        if compression == "gzip":
            stream = gzip.GzipFile(fileobj=cast(IO[bytes], outer), mode="rb")
        elif compression == "bzip2":
            stream = bz2.BZ2File(cast(IO[bytes], outer))
        elif compression == "xz":
            stream = lzma.LZMAFile(cast(IO[bytes], outer))  # noqa: SIM115 - wraps outer, closed with it
        inner = _HashReader(stream, (layer.diff_id or "sha256:").partition(":")[0])
        entries = 0
        try:
            if inner.peek(1):  # an empty stream is an empty layer, not an error
                with tarfile.open(fileobj=cast(BinaryIO, inner), mode="r|") as tar:
                    entries = _Applier(tree, where, log).apply(tar)
            inner.drain()
            outer.drain()
        except SandfleetError:
            raise
        except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, gzip.BadGzipFile) as exc:
            raise InvalidArgument(
                f"{where} is not a readable tar"
                + (f" ({compression}-compressed)" if compression else "")
                + f": {exc}"
            ) from None
        except OSError as exc:  # bz2 and friends report corrupt data as OSError
            raise InvalidArgument(f"{where} cannot be read: {exc}") from None
    if layer.digest is not None:
        _verify(src, layer.name, layer.digest, outer.hash.hexdigest(), layer.digest.split(":")[1])
    if layer.size is not None and outer.size != layer.size:
        raise DataLoss(
            f"{where} is {outer.size} bytes, not {layer.size} as the image says: "
            "the file is corrupt or was changed; export the image again"
        )
    if layer.diff_id is not None:
        alg, _, want = layer.diff_id.partition(":")
        got = inner.hash.hexdigest()
        if got != want:
            raise DataLoss(
                f"{where}: its content has digest {alg}:{got}, not {layer.diff_id} as the "
                "image config's rootfs.diff_ids says: the file is corrupt or was changed"
            )
    return entries, inner.size


# --------------------------------------------------------------------------- applying one layer


class _Applier:
    """Applies a layer tar's entries into a tree, never following a symlink."""

    def __init__(self, tree: Path, where: str, log: Log) -> None:
        self.tree = tree
        self.where = where
        self.log = log
        self.dir_times: dict[tuple[str, ...], int] = {(): 0}

    def apply(self, tar: tarfile.TarFile) -> int:
        root_fd = os.open(self.tree, _DIR_FLAGS)
        try:
            count = 0
            for member in tar:
                count += 1
                try:
                    self._entry(root_fd, tar, member)
                except OSError as exc:
                    raise self._os_error(member.name, exc) from None
            self._set_dir_times(root_fd)
            return count
        finally:
            os.close(root_fd)

    # ---------------------------------------------------------------- names and directories

    def _parts(self, name: str, what: str = "entry") -> tuple[str, ...]:
        parts = tuple(p for p in name.split("/") if p not in ("", "."))
        if name.startswith("/") or ".." in parts or "\0" in name:
            raise InvalidArgument(
                f"{self.where}: {what} {name!r} is an absolute path or contains '..': "
                "refused, a layer may only name paths inside the image"
            )
        return parts

    def _open_dir(self, root_fd: int, parts: tuple[str, ...], entry: str, create: bool) -> int:
        """An fd of the directory ``parts`` below the root, created if missing and ``create``.

        Each component is opened with ``O_NOFOLLOW``: a symlink or non-directory on
        the way is refused. A whiteout there (same layer) becomes an opaque directory.
        """
        fd = os.dup(root_fd)
        try:
            for i, comp in enumerate(parts):
                try:
                    nfd = os.open(comp, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    nfd = self._mkdir(fd, comp, parts[: i + 1], opaque=False)
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    st = os.stat(comp, dir_fd=fd, follow_symlinks=False)
                    prefix = "/".join(parts[: i + 1])
                    if stat.S_ISLNK(st.st_mode):
                        raise InvalidArgument(
                            f"{self.where}: entry {entry!r} goes through {prefix!r}, a symlink "
                            "in this layer: refused, a layer may not write through a symlink"
                        ) from None
                    if not (create and _is_whiteout(st)):
                        raise InvalidArgument(
                            f"{self.where}: entry {entry!r} needs {prefix!r} to be a directory, "
                            "but the layer made it a file"
                        ) from None
                    os.unlink(comp, dir_fd=fd)
                    nfd = self._mkdir(fd, comp, parts[: i + 1], opaque=True)
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _mkdir(self, parent_fd: int, name: str, parts: tuple[str, ...], opaque: bool) -> int:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        os.fchmod(fd, 0o755)
        if opaque:  # whited out and recreated in one layer: hide what the layers below hold
            os.setxattr(fd, _OPAQUE_XATTR, b"y")
        self.dir_times.setdefault(parts, 0)
        return fd

    # ---------------------------------------------------------------- entries

    def _entry(self, root_fd: int, tar: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        parts = self._parts(m.name)
        if not parts:  # the layer's root directory
            if m.isdir():
                self._meta_fd(root_fd, m)
                self.dir_times[()] = _ns(m.mtime)
            return
        parent, base = parts[:-1], parts[-1]
        pfd = self._open_dir(root_fd, parent, m.name, create=True)
        try:
            if base == _OPAQUE:
                os.setxattr(pfd, _OPAQUE_XATTR, b"y")
            elif base.startswith(_WH):
                self._whiteout(pfd, base[len(_WH) :], m)
            elif m.isdir():
                self._dir(pfd, base, parts, m)
            elif m.islnk():
                self._hardlink(root_fd, pfd, base, parts, m)
            else:
                self._other(pfd, base, parts, tar, m)
        finally:
            os.close(pfd)

    def _whiteout(self, pfd: int, name: str, m: tarfile.TarInfo) -> None:
        if not name or name.startswith(_WH):  # ".wh." alone, or AUFS's own .wh..wh.* files
            return
        if _lstat(pfd, name) is not None:  # the layer's own entry of that name wins
            return
        os.mknod(name, stat.S_IFCHR | 0o600, os.makedev(0, 0), dir_fd=pfd)
        os.utime(name, ns=(_ns(m.mtime),) * 2, dir_fd=pfd, follow_symlinks=False)

    def _dir(self, pfd: int, name: str, parts: tuple[str, ...], m: tarfile.TarInfo) -> None:
        st = _lstat(pfd, name)
        if st is None or not stat.S_ISDIR(st.st_mode):
            if st is not None:
                os.unlink(name, dir_fd=pfd)
            os.close(self._mkdir(pfd, name, parts, opaque=st is not None and _is_whiteout(st)))
        fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
        try:
            self._meta_fd(fd, m)
        finally:
            os.close(fd)
        self.dir_times[parts] = _ns(m.mtime)

    def _hardlink(
        self, root_fd: int, pfd: int, name: str, parts: tuple[str, ...], m: tarfile.TarInfo
    ) -> None:
        target = self._parts(m.linkname, f"hard link target of {m.name!r}:")
        if not target or target == parts:
            raise InvalidArgument(f"{self.where}: hard link {m.name!r} -> {m.linkname!r} is bad")
        try:
            tfd = self._open_dir(root_fd, target[:-1], m.name, create=False)
        except FileNotFoundError:
            tfd = -1
        try:
            st = _lstat(tfd, target[-1]) if tfd >= 0 else None
            if st is None or stat.S_ISDIR(st.st_mode):
                raise InvalidArgument(
                    f"{self.where}: hard link {m.name!r} -> {m.linkname!r}: the target is not "
                    "a file earlier in this layer"
                )
            self._make_room(pfd, name)
            os.link(target[-1], name, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)
        finally:
            if tfd >= 0:
                os.close(tfd)

    def _other(
        self, pfd: int, name: str, parts: tuple[str, ...], tar: tarfile.TarFile, m: tarfile.TarInfo
    ) -> None:
        self._make_room(pfd, name)
        mode = m.mode & 0o7777
        if m.isreg():
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(name, flags, 0o600, dir_fd=pfd)
            with os.fdopen(fd, "wb") as out:
                data = tar.extractfile(m)
                if data is not None:
                    shutil.copyfileobj(data, out, _CHUNK)
                out.flush()
                self._meta_fd(fd, m)
                os.utime(fd, ns=(_ns(m.mtime),) * 2)
            return
        if m.issym():
            os.symlink(m.linkname, name, dir_fd=pfd)
        elif m.ischr() or m.isblk():
            kind = stat.S_IFCHR if m.ischr() else stat.S_IFBLK
            os.mknod(name, kind | 0o600, os.makedev(m.devmajor, m.devminor), dir_fd=pfd)
        elif m.isfifo():
            os.mkfifo(name, 0o600, dir_fd=pfd)
        else:
            raise InvalidArgument(
                f"{self.where}: entry {m.name!r} has tar type {m.type!r}, which images do not use"
            )
        os.chown(name, m.uid, m.gid, dir_fd=pfd, follow_symlinks=False)
        if not m.issym():  # a symlink's mode means nothing on Linux
            os.chmod(name, mode, dir_fd=pfd)  # the node just made here: not a symlink
        self._xattrs(os.path.join(self.tree, *parts), m, follow_symlinks=False)
        os.utime(name, ns=(_ns(m.mtime),) * 2, dir_fd=pfd, follow_symlinks=False)

    def _make_room(self, pfd: int, name: str) -> None:
        """Remove what an earlier entry put at ``name`` (a later entry replaces it, as in tar)."""
        st = _lstat(pfd, name)
        if st is None:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=pfd)
        else:
            os.unlink(name, dir_fd=pfd)

    # ---------------------------------------------------------------- metadata

    def _meta_fd(self, fd: int, m: tarfile.TarInfo) -> None:
        os.fchown(fd, m.uid, m.gid)  # before chmod: chown clears setuid bits
        os.fchmod(fd, m.mode & 0o7777)
        self._xattrs(fd, m)

    def _xattrs(self, target: int | str, m: tarfile.TarInfo, follow_symlinks: bool = True) -> None:
        for key, value in m.pax_headers.items():
            if key.startswith("SCHILY.xattr."):
                name, data = key[len("SCHILY.xattr.") :], value.encode("utf-8", "surrogateescape")
            elif key.startswith("LIBARCHIVE.xattr."):
                name = unquote(key[len("LIBARCHIVE.xattr.") :])
                try:
                    data = base64.b64decode(value + "=" * (-len(value) % 4), validate=True)
                except (binascii.Error, ValueError):
                    raise InvalidArgument(
                        f"{self.where}: entry {m.name!r} has a malformed xattr {key!r}"
                    ) from None
            else:
                continue
            if name.startswith("trusted.overlay."):
                continue  # overlayfs's own; only whiteouts may say what to hide
            try:
                os.setxattr(target, name, data, follow_symlinks=follow_symlinks)
            except OSError as exc:
                # not supported by this filesystem, or user.* on a symlink
                if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                self.log(f"{self.where}: xattr {name} of {m.name!r} not supported here: dropped")

    def _set_dir_times(self, root_fd: int) -> None:
        """Directory mtimes, set last: creating entries in a directory changes its mtime."""
        for parts, ns in self.dir_times.items():
            try:
                fd = self._open_dir(root_fd, parts, "/".join(parts), create=False)
            except (OSError, InvalidArgument):
                continue  # replaced later in the layer
            try:
                os.utime(fd, ns=(ns, ns))
            finally:
                os.close(fd)

    def _os_error(self, name: str, exc: OSError) -> SandfleetError:
        what = f"{self.where}: cannot apply entry {name!r}: {exc.strerror or exc}"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return ResourceExhausted(f"{what}; free disk space under the image store")
        if exc.errno in (errno.EPERM, errno.EACCES):
            return PermissionDenied(
                f"{what}; importing images needs root (it sets owners and makes device nodes)"
            )
        return InvalidArgument(what)


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _ns(mtime: float) -> int:
    return round(mtime * 1_000_000_000)
