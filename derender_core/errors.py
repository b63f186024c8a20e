"""The exceptions the library raises, and the exit statuses they map to.

Per-record problems never raise: they become error records. A
`DerenderError` means the run cannot start (bad flags, a missing model
directory, an unreadable input) and nothing was processed. `RunIncomplete`
(in `batch`, beside the report it carries) means a run that had started
could not finish: an input stopped being readable or an output writable.
Nothing here imports the rest of the core. Exit statuses are decided here, in the
core, so every front end (CLI, workers) reports the same outcome the same way.
"""

from __future__ import annotations

from enum import IntEnum


class ExitStatus(IntEnum):
    """What a run came to, as the process exit status."""

    OK = 0
    """Every record got a successful answer."""
    RECORDS_FAILED = 1
    """Some records got error records, each aligned with its input record."""
    USAGE = 2
    """A usage or configuration error: nothing was processed."""
    INCOMPLETE = 3
    """The run could not finish: an input or output failed mid-run (the
    output holds the records written before the failure), or derender hit a
    bug outside any one record."""
    NO_ANSWERS = 4
    """``diff``: an input holds no answer at all, so nothing was compared."""


class DerenderError(Exception):
    """A usage or configuration problem; the run cannot start."""

    exit_status = ExitStatus.USAGE


class ConfigError(DerenderError):
    """A setting is missing, unknown or has a bad value."""


class InputError(DerenderError):
    """An input or output file cannot be opened."""


class RecordError(DerenderError):
    """One record cannot be derendered. It becomes an error record in the
    output and the run goes on; it never ends a run."""


class StreamFailure(Exception):
    """An input that can no longer be read (a truncated or corrupt gzip, a
    read error) or an output that can no longer be written (a full disk).
    Raised mid-run by readers and writers; `batch.run` turns it into
    `batch.RunIncomplete`."""

    exit_status = ExitStatus.INCOMPLETE
