"""The one exception type for mistakes a user can fix.

Any layer may raise :class:`UserError`; only the CLI turns it into one red line and exit code 2.
Every other exception is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input: the message says what was wrong and what to do."""

    exit_code = 2
