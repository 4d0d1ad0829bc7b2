"""``python -m aegis.cli``."""

from . import main

main()
