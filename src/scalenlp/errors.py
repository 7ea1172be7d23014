"""The one exception type for mistakes a user can fix; the CLI prints it as a single `error:` line, exit 2."""


class UserError(Exception):
    """What is wrong and how to fix it, in one sentence."""
