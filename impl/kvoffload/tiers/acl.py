"""The least-privilege ACL user of one tenant's store: its key prefix and the commands a
store sends, nothing else (no ``SCAN``, no ``KEYS``, no ``FLUSHALL``, no ``CLIENT``: a store
never names its connection, so a user without ``CLIENT SETNAME`` works)."""

from __future__ import annotations

import hashlib

from kvoffload_spec.errors import InvalidArgumentError

# The commands a store sends after AUTH (which every user may send).
COMMANDS = ("mget", "mset", "exists", "unlink", "ping")
# And what a cluster store sends too: the slot map's read, and the ASK redirect's prefix.
CLUSTER_COMMANDS = ("cluster|nodes", "asking")


def acl_rule(
    user: str, password: str, key_prefix: str, *, db: int = 0, cluster: bool = False
) -> str:
    """The ``ACL SETUSER`` line of a least-privilege user for one tenant: on with
    ``password`` (stored as its SHA-256, so the line does not show it), only keys under
    ``key_prefix`` (a store's ``key_prefix``), no channels, and only the commands a store
    sends (``SELECT`` too with a ``db`` other than 0; ``CLUSTER NODES`` and ``ASKING`` with
    ``cluster``: run the line on every node of the cluster)."""
    for name, value in (("user", user), ("password", password), ("key_prefix", key_prefix)):
        if not isinstance(value, str) or not value or any(c.isspace() for c in value):
            raise InvalidArgumentError(f"{name} must be a non-empty str without spaces")
    if any(c in key_prefix for c in "*?[]\\"):
        raise InvalidArgumentError("key_prefix holds a glob character")
    digest = hashlib.sha256(password.encode()).hexdigest()
    granted = (*COMMANDS, *(("select",) if db else ()), *(CLUSTER_COMMANDS if cluster else ()))
    commands = " ".join(f"+{command}" for command in granted)
    return f"ACL SETUSER {user} reset on #{digest} ~{key_prefix}* resetchannels -@all {commands}"
