"""Safe extraction of tar and zip archives (sdists) into a directory.

Refused: absolute names, names or link targets that leave the destination,
writes through symlinks, device files and FIFOs. Extracted files get modes
0644/0755 (no setuid/setgid, no group/other write) and the extracting
user as owner; the image packer makes them root-owned.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import stat
import tarfile
import zipfile
from pathlib import Path

from sandfleet.wire.errors import InvalidArgument

__all__ = ["ARCHIVE_SUFFIXES", "extract_archive", "is_archive"]

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar", ".zip")


def is_archive(path: Path) -> bool:
    """True when ``path``'s name ends in a supported archive suffix."""
    return str(path).lower().endswith(ARCHIVE_SUFFIXES)


def extract_archive(archive: Path, dest: Path) -> None:
    """Extract the tar (gz/bz2/xz) or zip file ``archive`` into the existing directory ``dest``.

    Raises :class:`InvalidArgument` naming the offending member for anything
    unsafe (see the module docstring) or for a file that is not an archive.
    """
    archive = Path(archive)
    try:
        if zipfile.is_zipfile(archive):
            _extract_zip(archive, dest)
        else:
            _extract_tar(archive, dest)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError) as exc:
        raise InvalidArgument(
            f"{archive.name} is not a readable tar or zip archive: {exc}"
        ) from None


def _target(dest: Path, name: str, archive: Path) -> Path:
    norm = posixpath.normpath(name.replace("\\", "/"))
    if name.startswith("/") or norm == ".." or norm.startswith("../") or norm in ("", "."):
        raise InvalidArgument(f"{archive.name}: member {name!r} would land outside the target")
    out = dest / norm
    parent = os.path.realpath(out.parent)
    if parent != os.path.realpath(dest) and not parent.startswith(os.path.realpath(dest) + os.sep):
        raise InvalidArgument(f"{archive.name}: member {name!r} would be written through a symlink")
    if out.is_symlink():
        out.unlink()
    return out


def _check_link(dest: Path, out: Path, link: str, archive: Path) -> None:
    """Refuse a symlink at ``out`` whose target, resolved from where it really lands, escapes."""
    root = os.path.realpath(dest)
    resolved = os.path.normpath(os.path.join(os.path.realpath(out.parent), link))
    if link.startswith("/") or (resolved != root and not resolved.startswith(root + os.sep)):
        name = out.relative_to(dest)
        raise InvalidArgument(f"{archive.name}: link {str(name)!r} -> {link!r} leaves the target")


def _mode(mode: int) -> int:
    return 0o755 if mode & 0o111 else 0o644


def _extract_tar(archive: Path, dest: Path) -> None:
    with tarfile.open(archive) as tar:
        for m in tar:
            out = _target(dest, m.name, archive)
            if m.isdir():
                out.mkdir(parents=True, exist_ok=True)
                out.chmod(0o755)
            elif m.isfile():
                out.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(m)
                assert src is not None
                with src, open(out, "wb") as fh:
                    shutil.copyfileobj(src, fh)
                out.chmod(_mode(m.mode))
            elif m.issym():
                out.parent.mkdir(parents=True, exist_ok=True)
                _check_link(dest, out, m.linkname, archive)
                out.unlink(missing_ok=True)
                os.symlink(m.linkname, out)
            elif m.islnk():
                linked = _target(dest, m.linkname, archive)
                if not linked.is_file() or linked.is_symlink():
                    raise InvalidArgument(f"{archive.name}: hard link {m.name!r} has no target")
                out.parent.mkdir(parents=True, exist_ok=True)
                out.unlink(missing_ok=True)
                os.link(linked, out)
            else:
                raise InvalidArgument(
                    f"{archive.name}: member {m.name!r} is a device, FIFO or other special file"
                )


def _extract_zip(archive: Path, dest: Path) -> None:
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            out = _target(dest, info.filename, archive)
            mode = info.external_attr >> 16
            if info.is_dir():
                out.mkdir(parents=True, exist_ok=True)
                out.chmod(0o755)
                continue
            if mode and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
                raise InvalidArgument(f"{archive.name}: member {info.filename!r} is a special file")
            out.parent.mkdir(parents=True, exist_ok=True)
            if stat.S_ISLNK(mode):
                link = zf.read(info).decode("utf-8")
                _check_link(dest, out, link, archive)
                os.symlink(link, out)
                continue
            with zf.open(info) as src, open(out, "wb") as fh:
                shutil.copyfileobj(src, fh)
            out.chmod(_mode(mode))
