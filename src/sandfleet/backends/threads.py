"""Blocking work in a worker thread that a cancellation must not cut short."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["settled"]

T = TypeVar("T")


async def settled(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread; on cancellation, wait for it before re-raising.

    Teardown after a cancelled create must see the mounts as they ended up, not
    race a thread still making them; a VM's guest must not run again while the
    host still reads its disk.
    """
    fut = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait({fut})
        raise
