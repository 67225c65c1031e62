"""Where settings come from, resolved in one place.

Precedence: command-line option, then environment variable, then default.

- state dir: ``--state-dir``, ``SANDFLEET_STATE_DIR``; default /var/lib/sandfleet
  for root, else ~/.local/share/sandfleet.
- images dir: ``--images-dir``, ``SANDFLEET_IMAGES_DIR``; default <state dir>/images.
- node token (nodes ↔ control plane): ``--token``, ``SANDFLEET_NODE_TOKEN``; default:
  generated once and kept in <state dir>/node-token (mode 0600).
- API token (SDK → control plane): ``--api-token``, ``SANDFLEET_TOKEN``; default none,
  allowed only while listening on loopback.
- control plane URL (SDK): ``url=``, ``SANDFLEET_URL``; default http://127.0.0.1:7070.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DEFAULT_URL", "default_images_dir", "default_state_dir"]

DEFAULT_URL = "http://127.0.0.1:7070"


def default_state_dir() -> Path:
    """The state directory when no option is given (see the table above)."""
    env = os.environ.get("SANDFLEET_STATE_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/sandfleet")
    return Path.home() / ".local" / "share" / "sandfleet"


def default_images_dir(state_dir: Path) -> Path:
    """The image store directory: ``SANDFLEET_IMAGES_DIR`` or ``<state_dir>/images``."""
    env = os.environ.get("SANDFLEET_IMAGES_DIR")
    return Path(env) if env else state_dir / "images"
