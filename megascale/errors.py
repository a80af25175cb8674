"""User-facing errors.

Anything the user can fix (a bad config value, a missing or corrupt file, a checkpoint of another model)
raises a `MegascaleError`. The CLI prints it as one line and exits with status 2 (3 for a non-finite
rollback, which the resilience driver recovers from); everything else is a bug and keeps its traceback.
"""


class MegascaleError(Exception):
    """A problem with the user's input, stated so that the message alone says what to fix."""


class ConfigError(MegascaleError):
    """A configuration field has a bad value, or a key does not exist."""


class DataError(MegascaleError):
    """Input data is missing, unreadable, corrupt or does not fit the model."""


class CheckpointError(MegascaleError):
    """A checkpoint is missing, corrupt, or was written for another model."""


class MeasurementError(MegascaleError):
    """This machine could not be measured as asked (a probe outlived its time on a busy machine)."""


class NonFiniteError(MegascaleError):
    """Training met a NaN/inf loss or gradient norm and its policy is to roll back (exit status 3)."""

    exit_status = 3
