"""``python -m app.cli``: the ``stepline`` command."""

from app.cli import main

main()
