"""``python -m sandfleet.cli`` runs the command line."""

from sandfleet.cli.main import main

main()
