"""The `derender` command-line interface (installed as ``derender_cli``)."""
