"""Bearer keys, for the server's API key and the training metrics exporter alike: read from the first line of a
file or from an environment variable (a key on a command line is visible to every user in `ps`, and a key in a
config would be copied into the run folder), and compared in constant time."""

from __future__ import annotations

import hmac
import os

from scalenlp.errors import UserError


def key_of_file(path: str, flag: str) -> str:
    """The first line of ``path``, stripped; ``flag`` names the option that gave the file, for the error."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read the key from {flag} {path}: {e}") from None
    if not first.strip():
        raise UserError(f"{flag} {path} is empty; put the key on its first line")
    return first.strip()


def key_of(path: str | None, flag: str, env: str) -> str | None:
    """The key in file ``path`` when one is given, else the ``env`` environment variable's; None: no key."""
    if path:
        return key_of_file(path, flag)
    return os.environ.get(env) or None


def authorized(header: str, key: str) -> bool:
    """``Authorization: Bearer KEY``; the scheme is case-insensitive (RFC 7235), the key compared in constant time."""
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
