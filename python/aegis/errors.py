"""The one error for bad input named by a user: which option, what is wrong with it, and the fix."""

from __future__ import annotations


class UsageError(ValueError):
    """Bad input: a one-line message naming the option and the fix (the CLI exits with code 2)."""

    def __init__(self, option: str, message: str) -> None:
        self.option = option
        super().__init__(f"{option}: {message}" if option else message)
