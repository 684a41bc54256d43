"""User-facing errors: the CLI prints their message on one line and exits non-zero."""


class CachebackError(Exception):
    """A problem with the user's input (model path, prompt, drafter name, table file, ...)."""
