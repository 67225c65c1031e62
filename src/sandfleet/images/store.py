"""The local image store: content-addressed EROFS layers and named manifests.

Layout under ``root``::

    layers/sha256/<hex>.erofs       one file per distinct layer content
    manifests/<name>/<tag>.json     an ImageManifest (name may contain '/')
    tmp/                            scratch space for writes and builds

Every write goes to ``tmp/`` first and is renamed into place, so readers never
see a partial file and several processes can share one store. Layers are
immutable; tags move (``put`` replaces a tag's manifest).
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from pydantic import ValidationError

from sandfleet.node import mounts
from sandfleet.wire.errors import AlreadyExists, Internal, InvalidArgument, NotFound
from sandfleet.wire.models import ImageManifest, LayerDescriptor, LayerKind

from .refs import format_ref, parse_ref, validate_name, validate_tag

__all__ = ["ImageStore"]

_DIGEST_RE = re.compile(r"sha256:([0-9a-f]{64})")
_LAYER_KINDS = ("base", "toolkit", "workspace", "diff")
_CHUNK = 1 << 20


class ImageStore:
    """Images on local disk under ``root`` (created on first use)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.layers_dir = self.root / "layers" / "sha256"
        self.manifests_dir = self.root / "manifests"
        self.tmp_dir = self.root / "tmp"
        for d in (self.layers_dir, self.manifests_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"ImageStore({str(self.root)!r})"

    # ------------------------------------------------------------------ layers

    def layer_path(self, digest: str) -> Path:
        """Path of the layer file for ``digest`` (``'sha256:<64 hex>'``); it may not exist.

        Raises :class:`InvalidArgument` for a malformed digest.
        """
        m = _DIGEST_RE.fullmatch(digest)
        if not m:
            raise InvalidArgument(f"invalid layer digest {digest!r}: expected 'sha256:<64 hex>'")
        return self.layers_dir / f"{m.group(1)}.erofs"

    def add_layer(self, erofs_file: Path, kind: LayerKind) -> LayerDescriptor:
        """Move ``erofs_file`` into the store and describe it.

        The file is consumed: it is renamed (or copied, across filesystems)
        into ``layers/sha256/<hex>.erofs``; if a layer with the same content
        is stored already, the file is deleted and the stored one is kept.
        ``size`` in the answer is in bytes.

        Raises :class:`NotFound` if ``erofs_file`` does not exist and
        :class:`InvalidArgument` for an unknown ``kind``.
        """
        if kind not in _LAYER_KINDS:
            raise InvalidArgument(f"invalid layer kind {kind!r}: one of {', '.join(_LAYER_KINDS)}")
        src = Path(erofs_file)
        if not src.is_file():
            raise NotFound(f"layer file {src} does not exist")
        fd, tmp_name = tempfile.mkstemp(prefix="layer-", suffix=".tmp", dir=self.tmp_dir)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            try:
                os.replace(src, tmp)
            except OSError:  # another filesystem: copy, then drop the original
                shutil.copyfile(src, tmp)
                src.unlink()
            digest, size = _sha256(tmp)
            target = self.layer_path(digest)
            if target.exists():
                os.utime(target)  # fresh mtime: keeps a concurrent prune() away from it
            else:
                tmp.chmod(0o644)
                os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        return LayerDescriptor(digest=digest, size=size, kind=kind)

    # ------------------------------------------------------------------ manifests

    def _manifest_path(self, name: str, tag: str) -> Path:
        return self.manifests_dir / validate_name(name) / f"{validate_tag(tag)}.json"

    def put(self, manifest: ImageManifest, *, exclusive: bool = False) -> None:
        """Store ``manifest`` under its ``name:tag``, replacing any previous one atomically.

        With ``exclusive`` an existing ``name:tag`` is never replaced:
        :class:`AlreadyExists` is raised instead (atomic too: of two writers of
        the same tag, exactly one wins).

        Raises :class:`InvalidArgument` for an invalid name or tag and
        :class:`NotFound` if one of its layers is not in the store.
        """
        path = self._manifest_path(manifest.name, manifest.tag)
        for layer in manifest.layers:
            if not self.layer_path(layer.digest).is_file():
                raise NotFound(
                    f"cannot store {manifest.ref}: layer {layer.digest} is not in {self.root}; "
                    "add it with ImageStore.add_layer first"
                )
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix="manifest-", suffix=".tmp", dir=self.tmp_dir)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(manifest.model_dump_json(indent=2))
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp_name, 0o644)
            if not exclusive:
                os.replace(tmp_name, path)
                return
            try:
                os.link(tmp_name, path)  # fails if the tag exists, unlike rename
            except FileExistsError:
                raise AlreadyExists(
                    f"image {manifest.ref} already exists in {self.root}: choose another"
                    " name or tag, or remove it first (`sandfleet image rm`)"
                ) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name)

    def resolve(self, ref: str) -> ImageManifest:
        """The manifest for ``'name[:tag]'`` (tag defaults to ``latest``).

        Raises :class:`InvalidArgument` for a malformed reference and
        :class:`NotFound` (listing the images that exist) for an unknown one.
        """
        name, tag = parse_ref(ref)
        path = self._manifest_path(name, tag)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            existing = ", ".join(sorted(m.ref for m in self.list())) or "none"
            raise NotFound(
                f"image {format_ref(name, tag)!r} not found in {self.root} "
                f"(images there: {existing}); build one with `sandfleet image build`"
            ) from None
        return _load(path, text)

    def list(self) -> list[ImageManifest]:
        """Every stored manifest, sorted by ``name:tag``; unreadable files are skipped."""
        found = []
        for path in self.manifests_dir.rglob("*.json"):
            try:
                found.append(_load(path, path.read_text(encoding="utf-8")))
            except (OSError, Internal):
                continue
        return sorted(found, key=lambda m: (m.name, m.tag))

    def remove(self, ref: str) -> ImageManifest:
        """Delete the manifest of ``ref`` and return it; its layers stay until :meth:`prune`.

        Raises :class:`NotFound` if there is no such image.
        """
        manifest = self.resolve(ref)
        self._manifest_path(manifest.name, manifest.tag).unlink(missing_ok=True)
        return manifest

    def prune(self, min_age_s: float = 3600.0) -> builtins.list[str]:
        """Delete layers no manifest references and that are older than ``min_age_s`` seconds.

        The age guard protects a layer another process has just added but not
        yet referenced from a manifest. Returns the digests removed.
        """
        used = {layer.digest for m in self.list() for layer in m.layers}
        removed = []
        now = time.time()
        for path in self.layers_dir.glob("*.erofs"):
            digest = f"sha256:{path.stem}"
            if digest in used:
                continue
            with contextlib.suppress(FileNotFoundError):
                if now - path.stat().st_mtime >= min_age_s:
                    path.unlink()
                    removed.append(digest)
        return removed

    # ------------------------------------------------------------------ scratch

    @contextlib.contextmanager
    def scratch(self, prefix: str = "build-") -> Iterator[Path]:
        """A fresh directory under ``tmp/`` (same filesystem as the layers), removed on exit.

        Anything still mounted below it (debootstrap mounts /proc and /sys in
        its target) is unmounted first; if that fails the directory is left
        in place and :class:`Internal` is raised rather than deleting through
        a mount.
        """
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=self.tmp_dir))
        try:
            yield path
        finally:
            remove_tree(path)


def remove_tree(path: Path) -> None:
    """Unmount everything below ``path``, then delete it. Raises :class:`Internal` if busy."""
    for point in mounts.mounts_under(path):
        with contextlib.suppress(OSError):
            mounts.umount(point, mounts.MNT_DETACH)
    left = mounts.mounts_under(path)
    if left:
        raise Internal(f"could not unmount {', '.join(left)}; left {path} in place")
    shutil.rmtree(path, ignore_errors=True)


def _load(path: Path, text: str) -> ImageManifest:
    try:
        return ImageManifest.model_validate_json(text)
    except ValidationError as exc:
        raise Internal(f"corrupt manifest {path}: {exc}") from None


def _sha256(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return f"sha256:{h.hexdigest()}", size
