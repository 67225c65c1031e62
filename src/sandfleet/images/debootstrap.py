"""Build a Debian ``base`` layer with debootstrap."""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from sandfleet.wire.errors import FailedPrecondition, InvalidArgument, Unavailable
from sandfleet.wire.models import ImageConfig, ImageManifest

from .build import Log, commit_layers, stderr_log
from .mirror import resolve_mirror
from .refs import parse_ref
from .store import ImageStore

__all__ = ["DEFAULT_ENV", "build_debootstrap"]

DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
_PKG_RE = re.compile(r"[a-z0-9][a-z0-9+.-]+")
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9.+-]*")
#: Directories every rootfs needs, with their modes (mount points and homes).
_DIRS = {"proc": 0o555, "sys": 0o555, "dev": 0o755, "tmp": 0o1777, "root": 0o700}
_NET_ERRORS = (
    "Failed getting release file",
    "Couldn't download",
    "Could not resolve",
    "Release signed",
)


def build_debootstrap(
    store: ImageStore,
    ref: str,
    packages: list[str],
    suite: str = "bookworm",
    mirror: str | None = None,
    variant: str = "minbase",
    *,
    apt_dir: Path = Path("/etc/apt"),
    log: Log = stderr_log,
) -> ImageManifest:
    """Bootstrap Debian ``suite`` (``variant``, plus ``packages``) into one ``base`` layer.

    The mirror is ``mirror``, else ``$SANDFLEET_DEBIAN_MIRROR``, else the
    host's apt sources under ``apt_dir`` (see :func:`resolve_mirror`). apt's
    caches are emptied, host-specific files (resolv.conf, hostname) are
    blanked and /proc /sys /dev /tmp /root exist. Config: ``PATH``,
    ``LANG=C.UTF-8``, workdir ``/root``. File mtimes are kept (Python's
    .pyc files are validated against them). Needs root and about 60 s;
    progress goes to ``log``. The build directory next to the store is
    unmounted and removed whether the build succeeds or not.

    Returns the stored manifest. Raises :class:`InvalidArgument` for a bad
    ref, package name or suite or when no mirror is known,
    :class:`FailedPrecondition` when debootstrap is missing or fails,
    :class:`Unavailable` when the mirror cannot be reached.
    """
    parse_ref(ref)
    for pkg in packages:
        if not _PKG_RE.fullmatch(pkg):
            raise InvalidArgument(f"invalid Debian package name {pkg!r} (e.g. 'python3')")
    for label, value in (("suite", suite), ("variant", variant)):
        if not _NAME_RE.fullmatch(value):
            raise InvalidArgument(f"invalid debootstrap {label} {value!r} (e.g. 'bookworm')")
    url = resolve_mirror(mirror, suite=suite, apt_dir=apt_dir)
    exe = shutil.which("debootstrap")
    if exe is None:
        raise FailedPrecondition(
            "debootstrap is not installed (Debian: apt-get install debootstrap)"
        )
    cmd = [exe, f"--variant={variant}"]
    if packages:
        cmd.append(f"--include={','.join(packages)}")
    with store.scratch("debootstrap-") as scratch:
        target = scratch / "rootfs"
        target.mkdir(mode=0o755)
        log(f"debootstrap {suite} ({variant}, +{len(packages)} packages) from {url}")
        t0 = time.monotonic()
        _run_debootstrap([*cmd, suite, str(target), url], target, log)
        log(f"debootstrap done in {time.monotonic() - t0:.0f} s")
        _tidy_rootfs(target)
        return commit_layers(
            store,
            ref,
            [target],
            scratch,
            kind="base",
            config=ImageConfig(env=dict(DEFAULT_ENV), workdir="/root"),
            source=f"debootstrap:{suite}/{variant}+{','.join(packages)}@{url}",
            preserve_mtime=True,
            log=log,
        )


def _run_debootstrap(cmd: list[str], target: Path, log: Log) -> None:
    tail: collections.deque[str] = collections.deque(maxlen=30)
    counts: collections.Counter[str] = collections.Counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    )
    assert proc.stdout is not None
    with proc:
        for line in proc.stdout:
            line = line.rstrip()
            tail.append(line)
            words = line.split()
            if len(words) < 2 or words[0] not in ("I:", "W:", "E:"):
                continue
            # Progress, not a line per package: each phase once, then every 25th line of it.
            counts[words[1]] += 1
            n = counts[words[1]]
            if words[0] != "I:" or n == 1:
                log(line)
            elif n % 25 == 0:
                log(f"I: {words[1]} ... ({n} so far)")
    if proc.returncode != 0:
        detail = "\n".join(tail)
        logfile = target / "debootstrap" / "debootstrap.log"
        if logfile.is_file():
            detail += "\n--- debootstrap.log (tail) ---\n" + "\n".join(
                logfile.read_text(errors="replace").splitlines()[-20:]
            )
        cls = Unavailable if any(s in detail for s in _NET_ERRORS) else FailedPrecondition
        raise cls(
            f"debootstrap failed (exit {proc.returncode}): {detail}\n"
            "Check the mirror (argument or $SANDFLEET_DEBIAN_MIRROR), the suite and package names."
        )


def _tidy_rootfs(root: Path) -> None:
    for pattern in ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*", "var/cache/apt/*.bin"):
        for p in root.glob(pattern):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
    for name in ("etc/resolv.conf", "etc/hostname"):  # debootstrap copies the host's
        p = root / name
        if p.is_file() or p.is_symlink():
            p.unlink()
            p.write_text("")
    for name, mode in _DIRS.items():
        d = root / name
        d.mkdir(exist_ok=True)
        os.chmod(d, mode)
