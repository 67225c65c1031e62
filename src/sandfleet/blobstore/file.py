"""``file://`` blob stores: a directory, local or on a shared file system."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path

from sandfleet.wire.errors import NotFound, PermissionDenied, ResourceExhausted, Unavailable

from .base import BlobStore, ObjectInfo, check_key

__all__ = ["FileBlobStore"]


class FileBlobStore(BlobStore):
    """Objects as files under ``root`` (created on first write).

    Writes go to a temporary file in ``root/tmp`` and are renamed into place,
    so readers on any node never see a partial object.
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.url = self.root.resolve().as_uri()

    def path(self, key: str) -> Path:
        """The file that holds ``key`` (it may not exist)."""
        return self.root / check_key(key)

    def get(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound(f"{key} is not in the blob store {self.url}") from None
        except OSError as e:
            raise Unavailable(f"reading {key} from {self.url}: {e}") from e

    def put(self, key: str, data: bytes) -> None:
        target = self.path(key)
        tmp_dir = self.root / "tmp"
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix="put-", dir=tmp_dir)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                os.chmod(tmp, 0o644)
                os.replace(tmp, target)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        except PermissionError as e:
            raise PermissionDenied(f"cannot write {key} to {self.url}: {e}") from e
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise ResourceExhausted(f"writing {key} to {self.url}: disk full") from e
            raise Unavailable(f"writing {key} to {self.url}: {e}") from e

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def list(self, prefix: str) -> list[ObjectInfo]:
        base = self.root / prefix.rstrip("/") if prefix.strip("/") else self.root
        found = []
        for dirpath, dirnames, filenames in os.walk(base):
            if Path(dirpath) == self.root:
                dirnames[:] = [d for d in dirnames if d != "tmp"]
            for name in filenames:
                p = Path(dirpath) / name
                key = p.relative_to(self.root).as_posix()
                if not key.startswith(prefix):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = p.stat()
                    found.append(ObjectInfo(key, st.st_size, st.st_mtime))
        return found

    def delete(self, key: str) -> None:
        try:
            self.path(key).unlink(missing_ok=True)
        except PermissionError as e:
            raise PermissionDenied(f"cannot delete {key} from {self.url}: {e}") from e
