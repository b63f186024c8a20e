"""``python -m derender_cli``."""

from .main import main

main()
