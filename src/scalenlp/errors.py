"""The exception types for mistakes a user can fix; the CLI prints them as a single `error:` line, exit 2."""


class UserError(Exception):
    """What is wrong and how to fix it, in one sentence."""


class ConfigError(UserError):
    """A problem the user can fix in their config or command line."""
