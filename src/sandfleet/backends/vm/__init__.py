"""The VM backends (``microvm``, ``vm``): QEMU guests booting sandfleet's own initramfs."""
