"""The one exception family the library raises.

Per-record problems never raise: they become error records. A
`DerenderError` means the run as a whole cannot go on (bad flags, a missing
model directory, an unreadable input) and nothing was, or will be, processed.
"""

from __future__ import annotations


class DerenderError(Exception):
    """A usage or configuration problem; the CLI maps it to exit status 2."""


class ConfigError(DerenderError):
    """A setting is missing, unknown or has a bad value."""


class InputError(DerenderError):
    """An input or output file cannot be opened."""


class RecordError(DerenderError):
    """One record cannot be derendered. It becomes an error record in the
    output and the run goes on; it never ends a run."""
