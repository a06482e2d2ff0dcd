"""Errors a user can cause, reported as one sentence (kept free of heavy imports so the app can use them)."""


class ConfigError(ValueError):
    """A user-caused configuration problem, reported as one sentence."""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (or its type), to quote inside a one-sentence error."""
    lines = str(error).strip().splitlines()
    return lines[0].rstrip(".") if lines else type(error).__name__


class RunError(RuntimeError):
    """A run that cannot go on (diverged, a replica that never arrived), reported as one sentence."""


class DamagedFile(ConfigError):
    """A file of a run (or one a run starts from) that cannot be read, reported as one sentence naming the file and
    what to do about it."""
