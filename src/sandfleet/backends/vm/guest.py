"""The guest's kernel and initramfs, built from Debian packages and cached.

Kernel: the ``vmlinuz`` of Debian's cloud kernel (the package the metapackage
``linux-image-cloud-amd64`` depends on), fetched once with ``apt-get
download``. Initramfs, a newc cpio written here (no cpio tool needed):

- ``/init``: :data:`INIT_SCRIPT` (``init.sh``), the boot contract below;
- ``/bin/busybox`` (the host's busybox-static) and a symlink per applet;
- ``/sandfleet-agent``: :func:`sandfleet.guest.build.agent_binary` (static);
- ``/lib/modules/<release>/<name>.ko`` for :data:`MODULES` and what they
  depend on (read from each module's ``.modinfo``: the package ships no
  ``modules.dep``, depmod makes it at install), listed dependencies first in
  ``/lib/modules/<release>/load-order``;
- ``/sandfleet/masked-paths`` and ``/sandfleet/readonly-paths``: the container
  backend's lists (``bundle.MASKED_PATHS``, ``READONLY_PATHS``), one a line;
- ``/dev/console``, so init has a console before it mounts devtmpfs.

Boot contract (what the VM backend passes; init.sh implements it). Kernel
command line after ``console=ttyS0 ...``: ``sandfleet.layers=N``,
``sandfleet.memory_mb=M`` (memory.max of the sandbox's cgroup, MiB),
``sandfleet.pids=P`` (pids.max), optionally ``sandfleet.probe=1`` (print
``sandfleet-probe-ok`` and power off at once) and ``sandfleet.debug=1``
(print the mounts and the root's listing before the agent starts). Disks are
virtio-blk, found by serial: ``sfl<i>m`` layer i's EROFS image (its metadata
when split), ``sfl<i>d`` its data blob (absent for a whole image), ``sfdisk``
the writable ext4 disk. The agent's virtio-serial port is named
``sandfleet.agent``. Init prints ``sandfleet-init: starting agent`` just
before ``switch_root``; on any failure ``sandfleet-init: <what failed>`` and
it powers off (run QEMU with ``-no-reboot``). It also sets kernel.panic=-1,
so the VM ends (reboots, i.e. QEMU exits) if the agent, PID 1, dies.

Artifacts live in ``<cache>/guest/<key>/`` (cache: ``$SANDFLEET_CACHE_DIR``,
default ``~/.cache/sandfleet``); the key covers every input, so a new kernel
package, busybox, agent or init.sh gives a new directory and old ones stay
valid for VMs still running from them.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import json
import lzma
import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from sandfleet.wire.errors import FailedPrecondition, Internal, SandfleetError

__all__ = [
    "BUSYBOX",
    "INIT_SCRIPT",
    "KERNEL_METAPACKAGE",
    "MODULES",
    "GuestArtifacts",
    "guest_artifacts",
    "newc_archive",
]

Log = Callable[[str], None]

#: Bump when the way the initramfs is assembled changes: it is part of the key.
RECIPE_VERSION = 1
KERNEL_METAPACKAGE = "linux-image-cloud-amd64"
BUSYBOX = Path("/bin/busybox")
INIT_SCRIPT = Path(__file__).with_name("init.sh")
#: Modules init loads (with their dependencies): both virtio transports (mmio for
#: microvm, pci for q35), disks, the agent's port, the layers' and root's filesystems.
MODULES = ("virtio_mmio", "virtio_pci", "virtio_blk", "virtio_console", "erofs", "overlay")
#: Options init relies on that are not modules: a kernel without them cannot boot a box.
_BUILTIN_CONFIG = (
    "CONFIG_BLK_DEV_INITRD",
    "CONFIG_DEVTMPFS",
    "CONFIG_EXT4_FS",
    "CONFIG_MEMCG",
    "CONFIG_CGROUP_PIDS",
    "CONFIG_SERIAL_8250_CONSOLE",
)
#: Uncompressed: 3.0 MiB raw vs 1.3 MiB gzipped boot equally fast under TCG
#: (1.4 s to the probe marker either way, 6 boots each; lz4 and zstd too), so
#: nothing to decompress and nothing to compress at build time.
COMPRESS = False


@dataclass(frozen=True)
class GuestArtifacts:
    """A bootable guest: pass ``kernel`` as ``-kernel`` and ``initramfs`` as ``-initrd``.

    ``kernel_version`` is the kernel's release (``uname -r``, e.g.
    ``6.1.0-56-cloud-amd64``); ``key`` names the build (hex sha256 prefix) and
    changes whenever any input does.
    """

    kernel: Path
    initramfs: Path
    kernel_version: str
    key: str


def _stderr_log(line: str) -> None:
    print(f"sandfleet: {line}", file=sys.stderr, flush=True)


def guest_artifacts(cache_dir: Path | None = None, *, log: Log = _stderr_log) -> GuestArtifacts:
    """The guest for the current inputs, building it on first use (~2 s, plus a download).

    ``cache_dir`` defaults to ``$SANDFLEET_CACHE_DIR`` or ``~/.cache/sandfleet``.
    Safe to call from several threads or processes at once: one builds, the
    others wait on a lock file and reuse its result. A cached call costs a
    stat of apt's lists and hashing busybox and the agent (~3 ms).

    Raises FailedPrecondition when busybox-static is missing, the kernel package
    cannot be resolved or downloaded (``apt-get update``, a Debian apt source)
    or no C compiler can build the agent; Internal when the package lacks a
    module or option the guest needs.
    """
    from sandfleet.guest.build import _cache_dir, agent_binary

    root = (cache_dir if cache_dir is not None else _cache_dir()) / "guest"
    root.mkdir(parents=True, exist_ok=True)
    busybox = _static_busybox()
    agent = agent_binary()
    package, version = _kernel_package(root)
    masked, readonly = _path_lists()
    h = hashlib.sha256()
    for part in (
        f"recipe {RECIPE_VERSION} compress {COMPRESS} modules {' '.join(MODULES)}".encode(),
        f"kernel {package} {version}".encode(),
        busybox.read_bytes(),
        agent.read_bytes(),
        INIT_SCRIPT.read_bytes(),
        masked.encode(),
        readonly.encode(),
    ):
        h.update(hashlib.sha256(part).digest())
    key = h.hexdigest()[:24]
    out = root / key
    if not out.is_dir():
        with _locked(root / ".lock"):
            if not out.is_dir():  # another process may have built it meanwhile
                for stale in (*root.glob(".build-*"), *root.glob("debs/.download-*")):
                    shutil.rmtree(stale, ignore_errors=True)  # from a builder killed midway
                t0 = time.monotonic()
                deb = _download(root / "debs", package, version, log)
                _build(out, deb, busybox, agent, masked, readonly, log)
                log(f"guest {key} built in {time.monotonic() - t0:.1f} s")
    info = json.loads((out / "info.json").read_text())
    return GuestArtifacts(
        kernel=out / "vmlinuz",
        initramfs=out / "initramfs.img",
        kernel_version=info["release"],
        key=key,
    )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _path_lists() -> tuple[str, str]:
    from sandfleet.backends.container.bundle import MASKED_PATHS, READONLY_PATHS

    return "".join(p + "\n" for p in MASKED_PATHS), "".join(p + "\n" for p in READONLY_PATHS)


# --- inputs ------------------------------------------------------------------


def _is_static(path: Path) -> bool:
    """Whether an ELF executable has no program interpreter (PT_INTERP)."""
    with open(path, "rb") as fh:
        head = fh.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit only
            return False
        (phoff,) = struct.unpack_from("<Q", head, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
        fh.seek(phoff)
        table = fh.read(phentsize * phnum)
    return all(struct.unpack_from("<I", table, i * phentsize)[0] != 3 for i in range(phnum))


def _static_busybox() -> Path:
    if not BUSYBOX.exists():
        raise FailedPrecondition(
            f"{BUSYBOX} is missing; the VM guest needs it: apt-get install busybox-static"
        )
    if not _is_static(BUSYBOX):
        raise FailedPrecondition(
            f"{BUSYBOX} is dynamically linked (Debian's busybox package); the VM guest needs "
            "a static one: apt-get install busybox-static"
        )
    return BUSYBOX


def _apt_cache_show(package: str) -> dict[str, str]:
    try:
        proc = subprocess.run(
            ["apt-cache", "show", "--no-all-versions", package],
            capture_output=True, text=True, check=False, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        raise FailedPrecondition(f"apt-cache does not run ({exc}): the VM guest needs apt") from exc
    fields: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        name, sep, value = line.partition(": ")
        if sep and not line.startswith(" ") and name not in fields:
            fields[name] = value.strip()
    if proc.returncode != 0 or "Version" not in fields:
        raise FailedPrecondition(
            f"apt does not know {package} ({proc.stderr.strip() or 'no candidate'}): "
            "run apt-get update; the VM guest's kernel comes from a Debian apt source"
        )
    return fields


def _kernel_package(root: Path) -> tuple[str, str]:
    """(package, version) of the cloud kernel the metapackage depends on.

    apt-cache takes ~0.5 s here, so the answer is kept until apt's lists
    change; when apt cannot answer any more (lists deleted), the kept one stands.
    """
    saved = root / "kernel-package.json"
    try:
        stamp: int | None = Path("/var/lib/apt/lists").stat().st_mtime_ns
    except OSError:
        stamp = None
    known: tuple[str, str] | None = None
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        record = json.loads(saved.read_text())
        known = str(record["package"]), str(record["version"])
        if stamp is not None and record["lists_mtime_ns"] == stamp:
            return known
    try:
        package, version = _resolve_kernel_package()
    except FailedPrecondition:
        if known is None:
            raise
        return known
    if stamp is not None:
        with contextlib.suppress(OSError):
            record = {"lists_mtime_ns": stamp, "package": package, "version": version}
            _write_atomic(saved, json.dumps(record).encode())
    return package, version


def _resolve_kernel_package() -> tuple[str, str]:
    meta = _apt_cache_show(KERNEL_METAPACKAGE)
    package = next(
        (
            d.split()[0]
            for d in meta.get("Depends", "").split(",")
            if d.strip().startswith("linux-image-")
        ),
        None,
    )
    if package is None:
        raise Internal(f"{KERNEL_METAPACKAGE} depends on no linux-image package: {meta}")
    return package, _apt_cache_show(package)["Version"]


def _download(debs: Path, package: str, version: str, log: Log) -> Path:
    """The package's .deb, downloaded once into ``debs`` (older versions are removed)."""
    debs.mkdir(parents=True, exist_ok=True)
    deb = debs / f"{package}_{version.replace(':', '%3a')}.deb"
    if deb.exists():
        return deb
    log(f"downloading {package} {version}")
    # apt drops to its _apt user for downloads, which cannot write our directory.
    sandbox = ["-o", "APT::Sandbox::User=root"] if os.geteuid() == 0 else []
    with tempfile.TemporaryDirectory(dir=debs, prefix=".download-") as tmp:
        try:
            proc = subprocess.run(
                ["apt-get", "download", *sandbox, f"{package}={version}"],
                cwd=tmp, capture_output=True, text=True, check=False, timeout=600,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError) as exc:
            proc = subprocess.CompletedProcess([], 1, "", str(exc))
        got = list(Path(tmp).glob("*.deb"))
        if proc.returncode != 0 or len(got) != 1:
            raise FailedPrecondition(
                f"apt-get download {package}={version} failed: {proc.stderr.strip()[-500:]}; "
                "run apt-get update (the VM guest's kernel needs a reachable Debian apt source)"
            )
        os.replace(got[0], deb)
    for old in debs.glob(f"{package.split('-')[0]}-*.deb"):
        if old != deb:
            old.unlink(missing_ok=True)
    return deb


# --- the build -----------------------------------------------------------------


def _build(
    out: Path, deb: Path, busybox: Path, agent: Path, masked: str, readonly: str, log: Log
) -> None:
    """Extract the kernel and modules from ``deb``, write ``out/`` atomically."""
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".build-{out.name}-") as tmp:
        x = Path(tmp, "x")
        proc = subprocess.run(
            ["dpkg-deb", "-x", str(deb), str(x)], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            deb.unlink(missing_ok=True)  # a truncated download: fetch it again next time
            raise Internal(f"dpkg-deb -x {deb} failed: {proc.stderr.strip()}")
        vmlinuz = sorted((x / "boot").glob("vmlinuz-*"))
        moddirs = sorted(p for p in (*x.glob("lib/modules/*"), *x.glob("usr/lib/modules/*")))
        if len(vmlinuz) != 1 or len(moddirs) != 1:
            raise Internal(f"{deb.name}: expected one boot/vmlinuz-* and one lib/modules/*")
        release = moddirs[0].name
        _check_config(x / "boot" / f"config-{release}", deb.name)
        modules = _resolve_modules(moddirs[0], MODULES)
        log(f"kernel {release}; modules: {' '.join(name for name, _ in modules)}")

        entries = _initramfs_entries(release, modules, busybox, agent, masked, readonly)
        archive = newc_archive(entries)
        if COMPRESS:
            archive = gzip.compress(archive, compresslevel=6, mtime=0)
        new = Path(tmp, "out")
        new.mkdir()
        shutil.copyfile(vmlinuz[0], new / "vmlinuz")
        (new / "initramfs.img").write_bytes(archive)
        (new / "info.json").write_text(
            json.dumps(
                {
                    "release": release,
                    "package": deb.name,
                    "modules": [n for n, _ in modules],
                    "initramfs_bytes": len(archive),
                },
                indent=1,
            )
        )
        os.rename(new, out)


def _check_config(config: Path, what: str) -> None:
    try:
        text = config.read_text()
    except OSError as exc:
        raise Internal(f"{what} has no kernel config ({exc})") from exc
    have = {line.partition("=")[0] for line in text.splitlines() if line.endswith("=y")}
    missing = [o for o in _BUILTIN_CONFIG if o not in have]
    if missing:
        raise Internal(f"{what}: the VM guest needs {', '.join(missing)}=y in the kernel")


def _elf_section(data: bytes, name: bytes) -> bytes | None:
    """The contents of section ``name`` of a 64-bit little-endian ELF file, if any."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return None
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i: int) -> tuple[int, int, int]:
        base = shoff + i * shentsize
        (sh_name,) = struct.unpack_from("<I", data, base)
        sh_offset, sh_size = struct.unpack_from("<QQ", data, base + 0x18)
        return sh_name, sh_offset, sh_size

    _, str_off, str_size = header(shstrndx)
    names = data[str_off : str_off + str_size]
    for i in range(shnum):
        sh_name, off, size = header(i)
        if names[sh_name : names.index(b"\0", sh_name)] == name:
            return data[off : off + size]
    return None


def _read_module(path: Path) -> bytes:
    """A module's ELF bytes: busybox insmod loads only uncompressed ones."""
    data = path.read_bytes()
    if path.name.endswith(".ko.xz"):
        return lzma.decompress(data)
    if path.name.endswith(".ko.gz"):
        return gzip.decompress(data)
    if path.name.endswith(".ko"):
        return data
    raise Internal(f"{path.name}: unsupported module compression (the guest takes .ko, .xz, .gz)")


def _resolve_modules(moddir: Path, wanted: tuple[str, ...]) -> list[tuple[str, bytes]]:
    """``wanted`` and their dependencies as (name, ELF bytes), each after what it needs.

    Modules built into the kernel (``modules.builtin``) are skipped. Soft
    dependencies are not followed (``libcrc32c``'s ``crc32c`` is built in).
    """
    files: dict[str, Path] = {}
    for p in (moddir / "kernel").rglob("*.ko*"):
        files[p.name.split(".ko")[0].replace("-", "_")] = p
    builtin = {
        Path(line).name.split(".ko")[0].replace("-", "_")
        for line in (moddir / "modules.builtin").read_text().split()
    }
    order: list[tuple[str, bytes]] = []
    done: set[str] = set()

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if name in done or name in builtin:
            return
        if name in chain:
            raise Internal(f"module dependency cycle: {' -> '.join((*chain, name))}")
        if name not in files:
            raise Internal(f"the guest kernel has no module {name} (needed by {chain or 'init'})")
        data = _read_module(files[name])
        info = _elf_section(data, b".modinfo") or b""
        for field in info.split(b"\0"):
            if field.startswith(b"depends="):
                for dep in filter(None, field[8:].decode().split(",")):
                    visit(dep.replace("-", "_"), (*chain, name))
        done.add(name)
        order.append((name, data))

    for name in wanted:
        visit(name, ())
    return order


# --- the archive -----------------------------------------------------------------

#: One initramfs entry: (path without leading /, st_mode, data or symlink target, rdev).
Entry = tuple[str, int, bytes, tuple[int, int]]


def _initramfs_entries(
    release: str,
    modules: list[tuple[str, bytes]],
    busybox: Path,
    agent: Path,
    masked: str,
    readonly: str,
) -> list[Entry]:
    d, f, x = stat.S_IFDIR | 0o755, stat.S_IFREG | 0o644, stat.S_IFREG | 0o755
    none = (0, 0)
    entries: list[Entry] = [
        (name, d, b"", none)
        for name in ("bin", "dev", "proc", "sys", "newroot", "sandfleet", "lib", "lib/modules")
    ]
    entries += [
        ("dev/console", stat.S_IFCHR | 0o600, b"", (5, 1)),
        ("init", x, INIT_SCRIPT.read_bytes(), none),
        ("bin/busybox", x, busybox.read_bytes(), none),
        ("sandfleet-agent", x, agent.read_bytes(), none),
        ("sandfleet/masked-paths", f, masked.encode(), none),
        ("sandfleet/readonly-paths", f, readonly.encode(), none),
    ]
    applets = subprocess.run(
        [str(busybox), "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    entries += [
        (f"bin/{a}", stat.S_IFLNK | 0o777, b"busybox", none) for a in applets if a != "busybox"
    ]
    mdir = f"lib/modules/{release}"
    entries.append((mdir, d, b"", none))
    entries += [(f"{mdir}/{name}.ko", f, data, none) for name, data in modules]
    load_order = "".join(name + "\n" for name, _ in modules).encode()
    entries.append((f"{mdir}/load-order", f, load_order, none))
    return entries


def newc_archive(entries: list[Entry]) -> bytes:
    """A cpio archive in the kernel's initramfs format ("newc", ASCII headers).

    Every entry is owned by root with mtime 0 and a sequential inode number,
    so the same entries always give the same bytes. Parents must come before
    their children.
    """
    out = bytearray()

    def pad() -> None:
        out.extend(b"\0" * (-len(out) % 4))

    for ino, (name, mode, data, (rmajor, rminor)) in enumerate(
        [*entries, ("TRAILER!!!", 0, b"", (0, 0))], start=1
    ):
        raw = name.encode() + b"\0"
        nlink = 2 if stat.S_ISDIR(mode) else 1
        fields = (ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rmajor, rminor, len(raw), 0)
        out += b"070701" + b"".join(b"%08X" % v for v in fields) + raw
        pad()
        out += data
        pad()
    return bytes(out)


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def main() -> int:
    """``python -m sandfleet.backends.vm.guest``: build (or find) the guest, print its paths."""
    try:
        a = guest_artifacts()
    except SandfleetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"kernel    {a.kernel} ({a.kernel_version})")
    print(f"initramfs {a.initramfs} ({a.initramfs.stat().st_size} bytes)")
    print(f"key       {a.key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
