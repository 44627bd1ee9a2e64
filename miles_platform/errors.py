"""User-facing errors. The CLI prints these as one line (no traceback); each names what is wrong."""


class MilesError(Exception):
    """Base of every error caused by user input (config, data, checkpoints, publications)."""


class ConfigError(MilesError, ValueError):
    """A user mistake in the configuration: message names the flag and what is allowed."""


class DataError(MilesError, ValueError):
    """Bad dataset: message names file, line and key."""


class CheckpointError(MilesError, ValueError):
    """Bad or missing checkpoint: message names the path and what is missing."""


class PublicationError(MilesError, ValueError):
    """A weight publication that fails verification: message names version and tensor."""


class NonFiniteTraining(MilesError, RuntimeError):
    """The trainer met a NaN / inf loss or gradient more often than --max-nonfinite-steps allows:
    the run stopped before publishing the rollout's version; the checkpoint before it is intact."""


class ActorDied(MilesError, RuntimeError):
    """A trainer or engine actor of a run died: the run stopped; relaunching resumes it."""


class UserFunctionError(MilesError, RuntimeError):
    """A user function (--custom-rm-path, --custom-generate-function-path, ...) raised: the message
    names the flag, the function and its error."""


def retryable(error: BaseException) -> bool:
    """Can running the same step again succeed? Not after a user mistake (config, data, checkpoint,
    a user function that raised, non-finite training): those fail the same way again. A dead actor,
    a lost connection or anything unforeseen may be transient."""
    return not isinstance(error, MilesError) or isinstance(error, ActorDied)
