"""Where a tenant's secret comes from: an argument, a file, or the environment.

The same rule wherever a store is configured (``ValkeyStore(secret=...)``, vLLM's secondary
tier, SGLang's storage back end, ``kvoffload simulate --remote-secret-file``): the secret
given explicitly (an argument, a flag, a config entry, a file named by one of them) wins;
without one, the environment variable ``KVOFFLOAD_REMOTE_SECRET`` (the secret itself); with
neither, no secret (the plain format). A secret is never printed, logged or put in an error
message: only its source is named.
"""

from __future__ import annotations

import os

from kvoffload_spec.errors import InvalidArgumentError

from .values import secret_bytes

SECRET_ENV = "KVOFFLOAD_REMOTE_SECRET"
_MAX_SECRET_FILE = 64 * 1024


def read_secret_file(path: object) -> bytes:
    """The secret held by the file at ``path`` (surrounding whitespace, such as its final
    newline, is not part of it)."""
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"a secret file is a path; got {type(path).__name__}")
    try:
        with open(path, "rb") as file:
            raw = file.read(_MAX_SECRET_FILE + 1)
    except OSError as error:
        raise InvalidArgumentError(
            f"cannot read the secret file {os.fspath(path)!r}: {error.strerror}"
        ) from None
    if len(raw) > _MAX_SECRET_FILE:
        raise InvalidArgumentError(f"the secret file {os.fspath(path)!r} is over 64 KiB")
    return _checked(raw, f"the secret file {os.fspath(path)!r}")


def resolve_secret(
    secret: bytes | bytearray | str | None = None, secret_file: object = None
) -> bytes | None:
    """The secret to use: ``secret``, else the file ``secret_file``, else the environment's
    ``KVOFFLOAD_REMOTE_SECRET``, else ``None``."""
    if secret is not None and secret_file is not None:
        raise InvalidArgumentError("give a secret or a secret file, not both")
    if secret is not None:
        return _checked(secret, "the secret")
    if secret_file is not None:
        return read_secret_file(secret_file)
    from_env = os.environ.get(SECRET_ENV)
    if from_env is None:
        return None
    return _checked(from_env, f"${SECRET_ENV}")


def _checked(secret: object, source: str) -> bytes:
    try:
        raw = secret_bytes(secret)  # type: ignore[arg-type]
    except InvalidArgumentError as error:  # its message names lengths and types, never bytes
        raise InvalidArgumentError(f"{source}: {error}") from None
    if raw is None:
        raise InvalidArgumentError(f"{source} is empty")
    return raw
