"""``python -m raydeck.cli`` runs the ``raydeck`` command."""

from raydeck.cli.main import main

main()
