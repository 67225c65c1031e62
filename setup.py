"""Build hook only: metadata lives in pyproject.toml.

``build_py`` also compiles the in-sandbox agent (src/sandfleet/guest/agent.c)
into sandfleet/guest/_bin/sandfleet-agent. Without a C compiler the package
still installs (SDK-only machines need no agent) and says so;
``sandfleet.guest.build.agent_binary()`` then explains what to install.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
BUILD_PY = HERE / "src" / "sandfleet" / "guest" / "build.py"


def _load_build_module():  # type: ignore[no-untyped-def]
    # by path: the package's dependencies may not be installed at build time
    spec = importlib.util.spec_from_file_location("_sandfleet_agent_build", BUILD_PY)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildPyWithAgent(build_py):
    """build_py that also compiles the static agent binary."""

    def run(self) -> None:
        super().run()
        mod = _load_build_module()
        if getattr(self, "editable_mode", False):
            out = mod.PACKAGED_BINARY  # editable: next to agent.c in the source tree
        else:
            out = Path(self.build_lib) / "sandfleet" / "guest" / "_bin" / "sandfleet-agent"
        if os.environ.get("SANDFLEET_SKIP_AGENT_BUILD"):
            return
        try:
            mod.compile_agent(Path(out))
        except Exception as exc:
            print(f"warning: sandfleet-agent not built: {exc}", file=sys.stderr)


setup(cmdclass={"build_py": BuildPyWithAgent})
