"""User-facing errors: the CLI prints these as one line, without a traceback."""


class UserError(Exception):
    """Bad input the user can fix; the message says what was wrong and how to fix it."""
