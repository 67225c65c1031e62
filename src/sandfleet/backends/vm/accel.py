"""KVM if a guest really boots with it, else TCG (QEMU's software emulation).

``/dev/kvm`` opening and creating a VM proves little: under nested
virtualization a 64-bit guest can hang forever in KVM. So the probe boots the
real guest in probe mode (``sandfleet.probe=1``: init prints
``sandfleet-probe-ok`` and powers off) under ``-accel kvm`` and waits for the
marker. The answer is cached per host boot, QEMU version and guest build, in
``accel.json`` next to the guest's artifacts.

Under TCG on microvm the guest must also be told its TSC frequency
(:func:`tcg_kernel_args`): microvm has no HPET or ACPI PM timer, and
calibrating the TSC against the PIT fails often under emulation (timing
jitter), after which the kernel hangs early in boot, silently. Measured here
(QEMU 7.2, Debian 6.1 kernel): 7 hangs in 38 microvm boots without it (with
``-cpu max`` too), none in 50 with it; q35 (HPET) never hung.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import mmap
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sandfleet.backends.vm.guest import GuestArtifacts
from sandfleet.wire.errors import FailedPrecondition

__all__ = [
    "PROBE_MARKER",
    "AccelInfo",
    "host_tsc_khz",
    "probe_accel",
    "qemu_binary",
    "tcg_kernel_args",
]

PROBE_MARKER = b"sandfleet-probe-ok"
_QEMU = "qemu-system-x86_64"


@dataclass(frozen=True)
class AccelInfo:
    """The accelerator VMs use here; ``reason`` says why (e.g. why not KVM)."""

    name: Literal["kvm", "tcg"]
    reason: str


def qemu_binary() -> Path:
    """Path of ``qemu-system-x86_64``; FailedPrecondition if it is not on PATH."""
    exe = shutil.which(_QEMU)
    if exe is None:
        raise FailedPrecondition(f"{_QEMU} not found: apt-get install qemu-system-x86")
    return Path(exe)


def _qemu_version(qemu: Path) -> str:
    try:
        out = subprocess.run(
            [str(qemu), "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise FailedPrecondition(f"{qemu} --version does not run: {exc}") from exc
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise FailedPrecondition(f"{qemu} --version failed: {out.stderr.strip()}")
    return lines[0]


def probe_accel(artifacts: GuestArtifacts, *, timeout_s: float = 20) -> AccelInfo:
    """KVM if the guest boots under it within ``timeout_s`` seconds, else TCG and why.

    At most one real probe per host boot, QEMU version and guest build: the
    answer is kept in ``accel.json`` beside ``artifacts.kernel``. The probing
    QEMU is always killed and its files removed, even on timeout.
    Raises FailedPrecondition when QEMU is missing or does not run.
    """
    qemu = qemu_binary()
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = "unknown"
    key = f"{boot_id} {_qemu_version(qemu)} {artifacts.key}"
    cache = artifacts.kernel.parent / "accel.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        saved = json.loads(cache.read_text())
        if saved["key"] == key and saved["name"] in ("kvm", "tcg"):
            return AccelInfo(saved["name"], str(saved["reason"]))
    info = _probe(qemu, artifacts, timeout_s)
    with contextlib.suppress(OSError):
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=".accel.")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump({"key": key, "name": info.name, "reason": info.reason}, fh)
            os.chmod(tmp, 0o644)
            os.replace(tmp, cache)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return info


def _probe(qemu: Path, artifacts: GuestArtifacts, timeout_s: float) -> AccelInfo:
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return AccelInfo("tcg", f"/dev/kvm: {exc.strerror}")
    os.close(fd)
    with tempfile.TemporaryDirectory(prefix="sandfleet-kvm-probe-") as tmp:
        console, errors = Path(tmp, "console"), Path(tmp, "stderr")
        t0 = time.monotonic()
        with open(errors, "wb") as err:
            proc = subprocess.Popen(
                _probe_command(qemu, artifacts, console),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        try:
            outcome = _wait_for_marker(proc, console, t0 + timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        took = time.monotonic() - t0
        if outcome == "marker":
            return AccelInfo("kvm", f"a KVM guest booted in {took:.1f} s")
        if outcome == "exited":
            lines = errors.read_text(errors="replace").strip().splitlines()
            tail = lines[-1] if lines else "no message"
            return AccelInfo("tcg", f"QEMU with KVM failed (exit {proc.returncode}): {tail}")
        return AccelInfo(
            "tcg", f"KVM guest did not boot within {timeout_s:g} s: nested KVM unusable"
        )


def _wait_for_marker(
    proc: subprocess.Popen[bytes], console: Path, deadline: float
) -> Literal["marker", "exited", "timeout"]:
    """Poll the console file until the marker shows, QEMU exits or ``deadline`` passes."""
    while True:
        exited = proc.poll() is not None  # before reading: a last line is not missed
        with contextlib.suppress(FileNotFoundError):
            if PROBE_MARKER in console.read_bytes():
                return "marker"
        if exited:
            return "exited"
        if time.monotonic() >= deadline:
            return "timeout"
        time.sleep(0.05)


def _probe_command(qemu: Path, artifacts: GuestArtifacts, console: Path) -> list[str]:
    """The probing QEMU: microvm, tiny memory, console to a file, no other device."""
    return [
        str(qemu),
        "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-machine", "microvm,acpi=on",
        "-accel", "kvm", "-cpu", "host",
        "-m", "128", "-smp", "1",
        "-kernel", str(artifacts.kernel),
        "-initrd", str(artifacts.initramfs),
        "-append", "console=ttyS0 quiet panic=-1 sandfleet.probe=1",
        "-serial", f"file:{console}",
        "-display", "none",
    ]  # fmt: skip


def tcg_kernel_args() -> tuple[str, ...]:
    """Kernel parameters a TCG guest needs: ``tsc_early_khz=`` the host's TSC rate.

    Under TCG the guest's TSC ticks at the host's rate; given it, the kernel
    skips a calibration that hangs a microvm guest now and then (see the
    module docstring). Empty when the rate cannot be measured (not x86-64,
    or executable memory refused): boots then may hang, so say so in logs.
    Harmless on q35 and unused under KVM (kvmclock).
    """
    khz = host_tsc_khz()
    return (f"tsc_early_khz={khz}",) if khz else ()


# rdtsc; shl rdx, 32; or rax, rdx; ret
_RDTSC_CODE = bytes([0x0F, 0x31, 0x48, 0xC1, 0xE2, 0x20, 0x48, 0x09, 0xD0, 0xC3])


@functools.cache
def host_tsc_khz() -> int | None:
    """The host TSC's rate in kHz, measured against CLOCK_MONOTONIC_RAW over 50 ms.

    Linux exposes the rate it calibrated nowhere stable, so this runs the
    ``rdtsc`` instruction itself (10 bytes of machine code in a private
    read+exec page). Accurate to about 1 kHz (0.4 ppm at 2.6 GHz). None off
    x86-64 or when the page cannot be made executable. Cached per process.
    """
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    page.write(_RDTSC_CODE)
    anchor = ctypes.c_char.from_buffer(page)  # pins the page while it is in use
    try:
        addr = ctypes.addressof(anchor)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.mprotect(addr, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
            return None
        rdtsc = ctypes.CFUNCTYPE(ctypes.c_uint64)(addr)

        def sample() -> tuple[int, int]:
            """(ns, tsc) from the tightest of 5 clock-tsc-clock readings (no preemption)."""
            best = (1 << 62, 0, 0)
            for _ in range(5):
                a = time.clock_gettime_ns(time.CLOCK_MONOTONIC_RAW)
                t = rdtsc()
                b = time.clock_gettime_ns(time.CLOCK_MONOTONIC_RAW)
                best = min(best, (b - a, (a + b) // 2, t))
            return best[1], best[2]

        ns0, tsc0 = sample()
        time.sleep(0.05)
        ns1, tsc1 = sample()
        return round((tsc1 - tsc0) * 1_000_000 / (ns1 - ns0)) or None
    except (OSError, AttributeError):
        return None
    finally:
        del anchor
        page.close()
