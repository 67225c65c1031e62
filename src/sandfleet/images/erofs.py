"""Pack a directory tree into an EROFS image with mkfs.erofs (erofs-utils).

Images are uncompressed (DESIGN.md: 3.5 s vs 34 s with lz4hc for a Debian
tree; data is fetched on demand, so size matters less than pack time) and
reproducible: a fixed filesystem UUID and a fixed build time make the same
tree give the same bytes, hence the same digest.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from sandfleet.wire.errors import FailedPrecondition, Internal, NotFound, ResourceExhausted

__all__ = ["FILE_CHUNK", "FIXED_UUID", "MKFS", "pack_erofs"]

#: Filesystem UUID of every image sandfleet packs (any fixed value would do).
FIXED_UUID = "5a9df1ee-7c1a-4e0b-9a53-3f0d2c1b8e41"
#: Build time recorded when mtimes are preserved: 2100-01-01 UTC, in Unix seconds.
CLAMP_EPOCH = 4102444800
#: Bytes per chunk of a file in a split image: files' data is deduplicated at this
#: granularity inside a layer (smaller: more dedup, bigger chunk indexes).
FILE_CHUNK = 64 << 10
#: The mkfs.erofs executable (looked up on PATH).
MKFS = "mkfs.erofs"


def pack_erofs(
    src_dir: Path,
    out_file: Path,
    *,
    preserve_mtime: bool = False,
    all_root: bool = False,
    exclude_regex: Sequence[str] = (),
    blob_file: Path | None = None,
) -> Path:
    """Pack ``src_dir`` into the EROFS image ``out_file`` (uncompressed, 4 KiB blocks).

    With ``blob_file`` the image is split: ``out_file`` gets only the
    metadata (inodes, directories, chunk indexes) and ``blob_file`` every
    regular file's data, in chunks of :data:`FILE_CHUNK` bytes (identical
    chunks stored once); mount it with ``device=<blob_file>``.

    Owners, modes, xattrs, symlinks, hard links and device nodes of the tree
    are kept. By default every inode gets mtime 0 (``-T0``), so the same
    content always gives the same bytes; ``preserve_mtime=True`` keeps each
    file's mtime instead (mtimes after 2100 are clamped; the build time stays
    fixed, so an identical tree, mtimes included, still gives identical
    bytes). ``all_root=True`` makes
    every file owned by uid/gid 0. ``exclude_regex``: POSIX extended regular
    expressions matched against each path relative to ``src_dir`` (no leading
    ``/``, e.g. ``tmp/x``); a match leaves the file, or the directory with all
    below it, out of the image.

    The image is written to a temporary file next to ``out_file`` and renamed
    into place, so ``out_file`` is either complete or absent. Returns
    ``out_file``.

    Raises :class:`NotFound` if ``src_dir`` does not exist,
    :class:`FailedPrecondition` if mkfs.erofs is not installed,
    :class:`ResourceExhausted` if the disk is full and :class:`Internal`
    with mkfs.erofs's stderr for any other failure.
    """
    src_dir, out_file = Path(src_dir), Path(out_file)
    if not src_dir.exists():
        raise NotFound(f"cannot pack {src_dir}: it does not exist")
    exe = shutil.which(MKFS)
    if exe is None:
        raise FailedPrecondition(
            f"{MKFS} not found on PATH; install erofs-utils (Debian: apt-get install erofs-utils)"
        )
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out_file.name}.", suffix=".tmp", dir=out_file.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    cmd = [exe, "--quiet", f"-U{FIXED_UUID}"]
    env = dict(os.environ)
    env.pop("SOURCE_DATE_EPOCH", None)
    if preserve_mtime:
        # mkfs.erofs 1.5 reads SOURCE_DATE_EPOCH as a fixed build time that clamps newer
        # mtimes; a date far ahead clamps nothing (-T would set every mtime instead).
        env["SOURCE_DATE_EPOCH"] = str(CLAMP_EPOCH)
    else:
        cmd.append("-T0")
    if all_root:
        cmd.append("--all-root")
    cmd += [f"--exclude-regex={rx}" for rx in exclude_regex]
    if blob_file is not None:
        blob_file = Path(blob_file)
        blob_file.unlink(missing_ok=True)
        cmd += [f"--chunksize={FILE_CHUNK}", f"--blobdev={blob_file}"]
    cmd += [str(tmp), str(src_dir)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            raise _mkfs_error(proc, src_dir)
        tmp.chmod(0o644)
        os.replace(tmp, out_file)
    except BaseException:
        if blob_file is not None:
            blob_file.unlink(missing_ok=True)
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return out_file


def _mkfs_error(proc: subprocess.CompletedProcess[str], src_dir: Path) -> Exception:
    lines = []
    for line in (proc.stderr or proc.stdout or "").splitlines():
        if line.startswith("usage:"):  # mkfs.erofs appends its usage text; drop it
            break
        lines.append(line)
    detail = "\n".join(lines[-20:]).strip() or "(no output)"
    msg = f"mkfs.erofs failed (exit {proc.returncode}) packing {src_dir}: {detail}"
    if "No space left" in detail:
        return ResourceExhausted(msg + "; free disk space under the image store")
    return Internal(msg)
