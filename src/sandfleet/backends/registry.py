"""The backends a node offers, imported lazily so each stays optional."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from sandfleet.backends.base import Backend
from sandfleet.wire.errors import FailedPrecondition

__all__ = ["load_backends"]

log = logging.getLogger("sandfleet.node")

#: Kind → QEMU machine of the VM kinds.
VM_MACHINES = {"microvm": "microvm", "vm": "q35"}


def load_backends(node_dir: Path) -> dict[str, Backend]:
    """Backends by kind, with their state under ``node_dir/<kind>``.

    Raises FailedPrecondition (from the backend) when the host lacks what the
    container backend needs, with what to install. The VM kinds are left out,
    with a warning naming what is missing, on a host without QEMU or without
    the guest kernel; ``SANDFLEET_VM_TEMPLATES=0`` makes them boot every
    sandbox instead of restoring a template.
    """
    from sandfleet.backends.container import ContainerBackend
    from sandfleet.guest.build import agent_binary

    container = ContainerBackend(node_dir / "container", agent_binary(), node_id=node_dir.name)
    backends: dict[str, Backend] = {"container": container}
    try:
        backends.update(_vm_backends(node_dir))
    except FailedPrecondition as e:
        log.warning("microvm and vm sandboxes are not offered: %s", e.message)
    return backends


def _vm_backends(node_dir: Path) -> dict[str, Backend]:
    from sandfleet.backends.vm.accel import probe_accel, qemu_binary
    from sandfleet.backends.vm.backend import VmBackend
    from sandfleet.backends.vm.guest import guest_artifacts

    qemu = str(qemu_binary())
    artifacts = guest_artifacts()
    accel = probe_accel(artifacts)
    templates = os.environ.get("SANDFLEET_VM_TEMPLATES", "1") != "0"
    return {
        kind: VmBackend(
            node_dir / kind,
            kind,
            machine="microvm" if machine == "microvm" else "q35",
            artifacts=artifacts,
            accel=accel,
            qemu=qemu,
            templates=templates,
        )
        for kind, machine in VM_MACHINES.items()
    }
