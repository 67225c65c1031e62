"""The seccomp profile every container gets (OCI ``linux.seccomp``).

Default allow, EPERM for syscalls a sandboxed root has no business making.
Most of them already fail without the capability they need (we keep only
runc's three default capabilities); the filter is a second wall that also
covers kernel bugs reachable before the capability check (bpf, perf_event_open,
userfaultfd, keyctl). runc applies the filter as its very last step before
exec, so its own mounts and pivot_root are unaffected.
"""

from __future__ import annotations

import platform
from typing import Any

__all__ = ["EPERM", "seccomp_profile"]

EPERM = 1
_ENOSYS = 38
_CLONE_NEWUSER = 0x10000000

# Refused outright. Names unknown to an architecture (vm86 on x86_64, for
# instance) are skipped by runc, so one list serves all of them.
# fmt: off
_DENIED = [
    # kernel and module loading
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    # the filesystem tree: mounts could uncover what maskedPaths hides
    "mount", "umount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    # namespaces: unshare/setns are how user-namespace escapes start
    "unshare", "setns",
    # node-wide state
    "swapon", "swapoff", "reboot", "acct", "quotactl", "quotactl_fd",
    "clock_settime", "clock_settime64", "settimeofday", "stime", "adjtimex",
    "clock_adjtime", "clock_adjtime64", "sethostname", "setdomainname", "syslog",
    # large kernel attack surface
    "bpf", "perf_event_open", "userfaultfd", "lookup_dcookie",
    "keyctl", "add_key", "request_key",
    "open_by_handle_at", "name_to_handle_at",
    "iopl", "ioperm", "vm86", "vm86old", "uselib", "nfsservctl", "_sysctl",
    "kcmp", "process_vm_readv", "process_vm_writev",
    "fanotify_init", "create_module", "get_kernel_syms", "query_module",
]
# fmt: on

# personality(2) flags that weaken ASLR or make data executable, for exploits.
# One rule per flag: runc turns several conditions on one argument into
# separate rules (OR), so "value not in an allow list" cannot be expressed
# under a default-allow filter. Collateral: the query personality(0xffffffff)
# matches every mask and gets EPERM too; PER_LINUX32 (linux32) and UNAME26 pass.
_PERSONALITY_DENIED_FLAGS = [
    0x0040000,  # ADDR_NO_RANDOMIZE
    0x0100000,  # MMAP_PAGE_ZERO
    0x0200000,  # ADDR_COMPAT_LAYOUT
    0x0400000,  # READ_IMPLIES_EXEC
]


# The native ABI plus the compat ones a 64-bit kernel also accepts; a syscall
# from an unlisted ABI is killed by libseccomp's default bad-arch action.
_ARCHES = {
    "x86_64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "aarch64": ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
}


def seccomp_profile() -> dict[str, Any]:
    """The OCI ``linux.seccomp`` object (runtime spec 1.0.2, libseccomp >= 2.4)."""
    syscalls: list[dict[str, Any]] = [
        {"names": sorted(_DENIED), "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM},
        # clone with CLONE_NEWUSER: the only namespace an unprivileged process
        # may create, and the start of most container escapes.
        {
            "names": ["clone"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": EPERM,
            "args": [
                {
                    "index": 0,
                    "value": _CLONE_NEWUSER,
                    "valueTwo": _CLONE_NEWUSER,
                    "op": "SCMP_CMP_MASKED_EQ",
                }
            ],
        },
        # clone3 passes its flags in memory a filter cannot read; ENOSYS makes
        # glibc fall back to clone, which the rule above checks.
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": _ENOSYS},
        *(
            {
                "names": ["personality"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": EPERM,
                "args": [{"index": 0, "value": f, "valueTwo": f, "op": "SCMP_CMP_MASKED_EQ"}],
            }
            for f in _PERSONALITY_DENIED_FLAGS
        ),
    ]
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": _ARCHES.get(platform.machine(), []),
        "syscalls": syscalls,
    }
