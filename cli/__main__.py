"""``python -m derender_cli``."""

from .entry import main

main()
