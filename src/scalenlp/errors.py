"""The exception types for mistakes a user can fix; the CLI prints them as a single `error:` line, exit 2."""

import importlib


class UserError(Exception):
    """What is wrong and how to fix it, in one sentence."""


class ConfigError(UserError):
    """A problem the user can fix in their config or command line."""


def require(module: str, extra: str):
    """``module`` imported, or one line naming the extra that installs it (serving, Parquet and manifests are
    optional, so that a training-only install stays small)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"this needs the {module.split('.')[0]} package, which comes with scalenlp's {extra!r} "
                        f"extra: pip install 'scalenlp[{extra}]'") from None
