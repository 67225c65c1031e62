"""The ``container`` backend: runc, overlayfs over shared EROFS layers, cgroups v1/v2.

Importable on its own; needs root, runc and a kernel with overlayfs and EROFS.
"""

from sandfleet.backends.container.backend import ContainerBackend

__all__ = ["ContainerBackend"]
