"""The OCI runtime config (``config.json``, runtime spec 1.0.2) of one sandbox.

Written by code rather than by patching ``runc spec`` output: what a sandbox
may see and do is then in one reviewable place. The defaults mirror runc's
own ``runc spec`` (capabilities, masked and read-only paths, /dev mounts),
minus the terminal and plus our limits, seccomp filter and the agent (which also
holds CAP_SETUID and CAP_SETGID, see :data:`AGENT_CAPS` and :data:`COMMAND_CAPS`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sandfleet.backends.container.seccomp import seccomp_profile

if TYPE_CHECKING:
    from sandfleet.backends.base import BoxInit

__all__ = [
    "AGENT_CAPS",
    "AGENT_LISTEN_FD",
    "AGENT_PATH",
    "AGENT_RUN_DIR",
    "COMMAND_CAPS",
    "CPU_PERIOD_US",
    "DEFAULT_CAPS",
    "MASKED_PATHS",
    "READONLY_PATHS",
    "oci_config",
]

AGENT_PATH = "/.sandfleet/agent"
#: The agent's listening socket arrives as this fd (``runc run --preserve-fds 1``).
#: The node binds it outside the rootfs, so nothing inside can replace or reach it.
AGENT_LISTEN_FD = 3
#: Where the agent's supervisors of spawned processes listen: a small tmpfs of its
#: own, out of the way of a command cleaning /tmp or /run.
AGENT_RUN_DIR = "/.sandfleet/run"
CPU_PERIOD_US = 100_000
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# runc's default set: enough to send signals and bind low ports, nothing else.
DEFAULT_CAPS = ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"]
# The container's process (the agent) also holds what it needs to run a
# command as another user.
AGENT_CAPS = [*DEFAULT_CAPS, "CAP_SETGID", "CAP_SETUID"]
# What commands keep: the agent drops CAP_SETUID/CAP_SETGID and CAP_KILL from
# each (effective, permitted, inheritable; no_new_privs keeps them from coming
# back). Without CAP_KILL no command can signal the agent's own processes,
# which run under a uid of their own; root commands still signal root's.
COMMAND_CAPS = ["CAP_AUDIT_WRITE", "CAP_NET_BIND_SERVICE"]

# As in `runc spec` (1.1): hidden behind /dev/null (files) or an empty
# read-only tmpfs (directories) ...
MASKED_PATHS = [
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
]
# ... and remounted read-only.
READONLY_PATHS = [
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
]


def oci_config(
    *,
    sandbox_id: str,
    agent_host_path: str,
    env: dict[str, str],
    memory_mb: int,
    cpu: float,
    pids_limit: int,
    cgroups_path: str,
    nofile: int = 1024,
    init: BoxInit | None = None,
) -> dict[str, Any]:
    """The config.json object for one sandbox; the rootfs is ``<bundle>/rootfs``.

    ``memory_mb`` in MiB (swap limit equal, i.e. no swap), ``cpu`` in cores
    (CFS quota over a 100 ms period), ``pids_limit`` in tasks. ``agent_host_path``
    is the node path bind-mounted read-only at :data:`AGENT_PATH`; the agent
    listens on fd :data:`AGENT_LISTEN_FD`. Does no I/O and validates nothing: the
    backend checks limits first. ``nofile`` must not exceed the caller's own
    hard RLIMIT_NOFILE: runc sets it after dropping CAP_SYS_RESOURCE.
    With ``init`` (see :class:`~sandfleet.backends.base.BoxInit`) PID 1 is
    ``init.args`` instead of the agent and the root is read-only.
    """
    mem_bytes = memory_mb * 1024 * 1024
    environ = {"PATH": DEFAULT_PATH, "HOME": "/root", "TERM": "xterm"}
    environ.update(env)
    caps = list(AGENT_CAPS) if init is None else sorted(init.caps)
    args = [AGENT_PATH, "--listen-fd", str(AGENT_LISTEN_FD), "--run-dir", AGENT_RUN_DIR]
    own_mounts: list[dict[str, Any]] = [
        {
            "destination": AGENT_PATH,
            "type": "bind",
            "source": agent_host_path,
            "options": ["rbind", "ro", "nosuid", "nodev"],
        },
        {
            "destination": AGENT_RUN_DIR,
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "nodev", "noexec", "mode=700", "size=1m"],
        },
    ]
    if init is not None:
        args = list(init.args)
        own_mounts = [
            {"destination": dest, "type": "bind", "source": str(src),
             "options": ["rbind", "ro", "nosuid", "nodev"]}
            for dest, src in init.binds.items()
        ] + [
            {"destination": dest, "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=1777", f"size={size}m"]}
            for dest, size in init.tmpfs.items()
        ]  # fmt: skip
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": [f"{k}={v}" for k, v in environ.items()],
            "cwd": "/",
            "capabilities": {
                "bounding": caps,
                "effective": caps,
                "permitted": caps,
                "inheritable": [],
                "ambient": [],
            },
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile}],
            "noNewPrivileges": True,
        },
        "root": {"path": "rootfs", "readonly": init is not None},
        "hostname": sandbox_id[:63],
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {
                "destination": "/dev",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
            },
            {
                "destination": "/dev/pts",
                "type": "devpts",
                "source": "devpts",
                "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
            },
            {
                "destination": "/dev/shm",
                "type": "tmpfs",
                "source": "shm",
                "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
            },
            {
                "destination": "/dev/mqueue",
                "type": "mqueue",
                "source": "mqueue",
                "options": ["nosuid", "noexec", "nodev"],
            },
            {
                "destination": "/sys",
                "type": "sysfs",
                "source": "sysfs",
                "options": ["nosuid", "noexec", "nodev", "ro"],
            },
            *own_mounts,
        ],
        "linux": {
            "namespaces": [
                {"type": "pid"},
                {"type": "ipc"},
                {"type": "uts"},
                {"type": "mount"},
                # A fresh network namespace: runc brings its loopback up
                # (specconv adds a "loopback" network for a new netns).
                {"type": "network"},
                {"type": "cgroup"},
            ],
            "cgroupsPath": cgroups_path,
            "resources": {
                "devices": [{"allow": False, "access": "rwm"}],
                "memory": {"limit": mem_bytes, "swap": mem_bytes},
                "cpu": {
                    "quota": max(1000, round(cpu * CPU_PERIOD_US)),
                    "period": CPU_PERIOD_US,
                },
                "pids": {"limit": pids_limit},
            },
            "seccomp": seccomp_profile(),
            "maskedPaths": list(MASKED_PATHS),
            "readonlyPaths": list(READONLY_PATHS),
        },
    }
