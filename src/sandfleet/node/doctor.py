"""What this host offers sandfleet: kernel features and tools, probed for real.

Each check does the thing it reports on where that is cheap (mounts a tiny
EROFS image file-backed, opens /dev/kvm and creates a VM, runs each tool's
``--version``) rather than trusting a file's existence.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import fcntl
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sandfleet.node.mounts import MS_RDONLY, mount, umount

__all__ = ["Check", "kinds_offered", "run_checks"]

_KVM_GET_API_VERSION = 0xAE00
_KVM_CREATE_VM = 0xAE01


@dataclass(frozen=True)
class Check:
    """One probe: ``ok`` is whether the feature works; ``detail`` says what was seen."""

    name: str
    ok: bool
    detail: str


def _version(cmd: list[str]) -> tuple[bool, str]:
    exe = shutil.which(cmd[0])
    if exe is None:
        return False, "not installed"
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"does not run: {exc}"
    # Some tools (mkfs.erofs 1.5) print their version and exit non-zero.
    text = (out.stdout or out.stderr).strip().splitlines()
    return bool(text), text[0] if text else f"exit {out.returncode}, no output"


def _filesystems() -> set[str]:
    with contextlib.suppress(OSError):
        return {line.split()[-1] for line in Path("/proc/filesystems").read_text().splitlines()}
    return set()


def _cgroups() -> Check:
    from sandfleet.backends.container.cgroups import detect_layout

    layout = detect_layout()
    controllers = {c for cs in layout.v1_mounts.values() for c in cs}
    if layout.v2_mount:
        with contextlib.suppress(OSError):
            controllers |= set(Path(layout.v2_mount, "cgroup.controllers").read_text().split())
    needed = {"memory", "pids", "cpu"}
    missing = needed - controllers
    detail = f"{layout.mode}; controllers: {', '.join(sorted(needed & controllers)) or 'none'}"
    if missing:
        detail += f"; missing {', '.join(sorted(missing))}"
    # pause/resume freezes a box: the v1 freezer, or cgroup.freeze of v2.
    if "freezer" in controllers:
        detail += "; pause: v1 freezer"
    elif layout.mode == "v2":
        detail += "; pause: cgroup.freeze"
    else:
        detail += "; pause: no freezer (sandboxes cannot be paused)"
    return Check("cgroups", not missing, detail)


def _erofs_mount() -> Check:
    if os.geteuid() != 0:
        return Check("EROFS file-backed mount", False, "not probed: needs root")
    if shutil.which("mkfs.erofs") is None:
        return Check(
            "EROFS file-backed mount", False, "mkfs.erofs missing: apt install erofs-utils"
        )
    with tempfile.TemporaryDirectory(prefix="sandfleet-doctor-") as tmp:
        src, img, mnt = Path(tmp, "src"), Path(tmp, "probe.erofs"), Path(tmp, "mnt")
        src.mkdir()
        mnt.mkdir()
        (src / "probe").write_text("ok")
        subprocess.run(["mkfs.erofs", "--quiet", str(img), str(src)], check=True)
        try:
            mount(img, mnt, "erofs", MS_RDONLY)
        except OSError as exc:
            return Check("EROFS file-backed mount", False, str(exc))
        try:
            ok = (mnt / "probe").read_text() == "ok"
        finally:
            umount(mnt)
        return Check("EROFS file-backed mount", ok, "mounted and read a probe image")


def _kvm() -> Check:
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return Check("KVM", False, f"/dev/kvm: {exc.strerror}; VMs would use TCG emulation")
    try:
        api = fcntl.ioctl(fd, _KVM_GET_API_VERSION)
        vm = fcntl.ioctl(fd, _KVM_CREATE_VM, 0)
        os.close(vm)
    except OSError as exc:
        return Check("KVM", False, f"/dev/kvm opens but KVM_CREATE_VM fails: {exc}")
    finally:
        os.close(fd)
    return Check(
        "KVM",
        True,
        f"API {api}, creates VMs; whether a 64-bit guest boots is probed by the VM backends"
        " (nested KVM often hangs: they fall back to TCG)",
    )


def _vm_accel() -> Check:
    """Boots the VM guest under KVM (once per host boot, cached) or says why TCG."""
    from sandfleet.backends.vm.accel import probe_accel
    from sandfleet.backends.vm.guest import guest_artifacts
    from sandfleet.wire.errors import SandfleetError

    try:
        info = probe_accel(guest_artifacts(log=lambda _: None))
    except SandfleetError as exc:
        return Check("vm acceleration", False, f"not probed: {exc}")
    if info.name == "kvm":
        return Check("vm acceleration", True, f"kvm ({info.reason})")
    return Check("vm acceleration", True, f"tcg (software emulation): {info.reason}")


def run_checks() -> list[Check]:
    """Every probe, in display order."""
    fs = _filesystems()
    checks = [
        Check("kernel", True, f"{platform.system()} {platform.release()} {platform.machine()}"),
        Check(
            "root",
            os.geteuid() == 0,
            "running as root"
            if os.geteuid() == 0
            else "not root: the node agent needs root for mounts, cgroups and runc",
        ),
        _cgroups(),
        Check(
            "overlayfs",
            "overlay" in fs,
            "in /proc/filesystems" if "overlay" in fs else "missing: modprobe overlay",
        ),
        _erofs_mount(),
        Check(
            "FUSE",
            "fuse" in fs and Path("/dev/fuse").exists(),
            "/dev/fuse and fuse filesystem" if Path("/dev/fuse").exists() else "/dev/fuse missing",
        ),
        _kvm(),
        _vm_accel(),
        Check(
            "vhost-vsock",
            Path("/dev/vhost-vsock").exists(),
            "present" if Path("/dev/vhost-vsock").exists() else "absent: VMs use virtio-serial",
        ),
    ]
    for name, cmd in (
        ("runc", ["runc", "--version"]),
        ("crun", ["crun", "--version"]),
        ("qemu", ["qemu-system-x86_64", "--version"]),
        ("mkfs.erofs", ["mkfs.erofs", "--version"]),
        ("debootstrap", ["debootstrap", "--version"]),
    ):
        ok, detail = _version(cmd)
        checks.append(Check(name, ok, detail))
    libfuse = ctypes.util.find_library("fuse3")
    checks.append(
        Check(
            "libfuse3 (on-demand layers)",
            libfuse is not None,
            libfuse or "missing: apt-get install fuse3",
        )
    )
    compiler = shutil.which("musl-gcc") or shutil.which("cc")
    checks.append(Check("C compiler (agent build)", compiler is not None, compiler or "missing"))
    return checks


def kinds_offered(checks: list[Check]) -> dict[str, str]:
    """What each sandbox kind means on this host, from :func:`run_checks`' answers."""
    ok = {c.name: c.ok for c in checks}
    container_needs = [
        "root",
        "cgroups",
        "overlayfs",
        "EROFS file-backed mount",
        "runc",
        "FUSE",
        "libfuse3 (on-demand layers)",
    ]
    missing = [n for n in container_needs if not ok.get(n)]
    accel = next((c.detail for c in checks if c.name == "vm acceleration"), "")
    vm_missing = [n for n in ("root", "cgroups", "qemu", "vm acceleration") if not ok.get(n)]
    if vm_missing:
        vm_note = f"unavailable: {', '.join(vm_missing)} failed"
    else:
        vm_note = "available, " + ("KVM" if accel.startswith("kvm") else "TCG software emulation")
    container = "available" if not missing else f"unavailable: {', '.join(missing)} failed"
    return {
        "container": container,
        # fncall workers are container boxes whose PID 1 is the image's python3.
        "fncall": container + (" (images need python3 >= 3.9)" if not missing else ""),
        "microvm": vm_note,
        "vm": vm_note,
    }
