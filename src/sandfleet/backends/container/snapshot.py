"""Packing a running container's writable layer into an EROFS file, frozen meanwhile.

The box's processes are frozen with the cgroup freezer (see
:mod:`sandfleet.backends.container.freezer`) for exactly as long as
mkfs.erofs reads its upper directory, so the layer is a
consistent picture of one instant, as after a power cut: no file is caught
half renamed. A box that was paused already stays paused; any other is thawed
on every way out (an error, a cancellation). See :mod:`sandfleet.images.snapshot`
for what the upper directory holds and why it can be packed as it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sandfleet.backends.container.freezer import Freezer
from sandfleet.images.erofs import pack_erofs
from sandfleet.node.mounts import mount_table
from sandfleet.wire.errors import FailedPrecondition, Internal

__all__ = ["check_overlay", "pack_upper"]
_OVERLAY_PARAMS = Path("/sys/module/overlay/parameters")


def _overlay_options(rootfs: Path) -> list[str]:
    """The super options of the overlay mounted at ``rootfs``; [] if none is."""
    for entry in mount_table():
        if entry.point == str(rootfs) and entry.fstype == "overlay":
            return entry.options
    return []


def check_overlay(rootfs: Path) -> None:
    """Refuse overlays whose upper directory alone does not hold the box's changes.

    With ``redirect_dir=on`` a renamed directory points at its old path in the
    layers below, with ``metacopy=on`` a chmod'ed file keeps its data there:
    packed alone, such an upper directory would lose data. Raises
    ``FailedPrecondition`` saying what to change, ``Internal`` if ``rootfs``
    is no overlay mount.
    """
    opts = _overlay_options(rootfs)
    if not opts:
        raise Internal(f"{rootfs} is not an overlay mount")
    for feature in ("redirect_dir", "metacopy"):
        given = [o.partition("=")[2] for o in opts if o.startswith(feature + "=")]
        if given:
            on = given[-1] == "on"
        else:
            try:
                on = (_OVERLAY_PARAMS / feature).read_text().strip() == "Y"
            except OSError:
                on = False
        if on:
            raise FailedPrecondition(
                f"the box's overlay runs with {feature}=on, whose upper directory alone does not"
                f" hold its changes: load the overlay module with {feature}=N to snapshot boxes"
            )


async def pack_upper(
    freezer: Freezer,
    sandbox_id: str,
    bundle: Path,
    out_file: Path,
    exclude_regex: Sequence[str] = (),
    blob_file: Path | None = None,
) -> None:
    """Pack ``bundle/disk/upper`` into ``out_file`` (and ``blob_file``, split; see
    :func:`~sandfleet.images.erofs.pack_erofs`) with the box frozen meanwhile.

    Raises ``FailedPrecondition`` (no writable layer, an overlay that cannot be
    snapshotted, no freezer), ``Internal`` (the box did not freeze; it was
    left running) and what :func:`~sandfleet.images.erofs.pack_erofs` raises.
    ``out_file`` is either complete or absent.
    """
    upper = bundle / "disk" / "upper"
    if not upper.is_dir():
        raise FailedPrecondition(f"sandbox {sandbox_id} has no writable layer to snapshot")
    check_overlay(bundle / "rootfs")
    rel = f"/sandfleet/{sandbox_id}"
    was_frozen = freezer.frozen(rel)
    try:
        if not was_frozen:
            await _settled(asyncio.ensure_future(freezer.freeze(rel)))
        loop = asyncio.get_running_loop()
        packing = loop.run_in_executor(
            None,
            lambda: pack_erofs(
                upper,
                out_file,
                preserve_mtime=True,
                exclude_regex=exclude_regex,
                blob_file=blob_file,
            ),
        )
        await _settled(packing)
    finally:
        if not was_frozen:
            freezer.thaw_now(rel)  # no wait: nothing here needs the box running


async def _settled(fut: asyncio.Future[Any]) -> None:
    """Wait for ``fut``; on cancellation, let it end before re-raising: the box must
    not be thawed while a freeze is still under way or mkfs.erofs still reads."""
    try:
        await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait({fut})
        raise
