"""The installed formwork's version: `formwork --version`, GET /version and the
server's logs (no import beyond the standard library: the CLI asks it first)."""
from __future__ import annotations

from importlib import metadata


def version() -> str:
    try:
        return metadata.version("formwork")
    except metadata.PackageNotFoundError:     # a checkout that is not installed
        return "0.1.0"
