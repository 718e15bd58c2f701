"""Where a remote store's server is: its URL, checked whole before anything connects, and
shown only with its password replaced.

``redis://`` or ``valkey://[user:password@]host[:port][/db]``, ``rediss://`` or ``valkeys://``
for TLS, ``unix://[user:password@]/path[?db=N]`` for a socket. The query takes only the
options below; anything else (a client library's ``?max_connections=``, ``?decode_responses=``,
a typo) is refused, so a URL that works in another client never silently means something
else here:

- ``db=N``: the database (also the URL's path: ``/N``);
- ``tls_ca_file=PATH``: the CA certificates to verify the server with (TLS only);
- ``tls_verify=yes|no``: whether to verify the server's certificate and name (TLS only;
  ``yes`` by default).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

from kvoffload_spec.errors import InvalidArgumentError

TCP_SCHEMES = {"redis": False, "valkey": False, "rediss": True, "valkeys": True}
DEFAULT_PORT = 6379
URL_OPTIONS = ("db", "tls_ca_file", "tls_verify")
MAX_DB = 1 << 20
_TRUE = {"1", "yes", "true", "on"}
_FALSE = {"0", "no", "false", "off"}
_Complaint = Callable[[str], InvalidArgumentError]


@dataclass(frozen=True)
class ServerAddress:
    """A parsed, checked server URL (the password never in its repr)."""

    url: str  # as shown: the password replaced by ***
    host: str | None  # None for a unix socket
    port: int
    path: str | None  # the unix socket's path
    db: int
    username: str | None
    password: str | None = field(repr=False)
    tls: bool
    tls_ca_file: str | None
    tls_verify: bool

    @classmethod
    def parse(
        cls, url: object, *, tls_ca_file: str | None = None, tls_verify: bool | None = None
    ) -> ServerAddress:
        """``url`` checked; ``tls_ca_file`` and ``tls_verify``, when given, win over the
        URL's own options."""
        if not isinstance(url, str):
            raise InvalidArgumentError(f"url must be a str; got {type(url).__name__}")
        shown = redact(url)

        def bad(why: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"not a usable Valkey/Redis URL: {shown!r}: {why}")

        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as error:
            raise bad(str(error).replace(url, shown)) from None
        scheme = parts.scheme.lower()
        if scheme not in TCP_SCHEMES and scheme != "unix":
            raise bad("the scheme must be redis://, valkey://, rediss://, valkeys:// or unix://")
        if parts.fragment:
            raise bad("a URL fragment (#...) means nothing here")
        options: dict[str, str] = {}
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            if name not in URL_OPTIONS:
                raise bad(
                    f"unknown option {name!r}: the URL takes only {', '.join(URL_OPTIONS)} "
                    "(timeouts, sizes and the secret are ValkeyStore's arguments)"
                )
            if name in options:
                raise bad(f"option {name!r} given twice")
            options[name] = value
        username = unquote(parts.username) if parts.username else None
        password = unquote(parts.password) if parts.password is not None else None
        if "@" in parts.netloc and password is None:
            raise bad("put the password after a colon: scheme://:password@host (or user:password)")
        db = _db(options.pop("db", None), parts.path if scheme != "unix" else "", bad)
        tls = TCP_SCHEMES.get(scheme, False)
        ca_file = tls_ca_file if tls_ca_file is not None else options.get("tls_ca_file")
        verify = tls_verify if tls_verify is not None else _flag(options.get("tls_verify"), bad)
        if not tls and (ca_file is not None or verify is not None):
            raise bad("tls_ca_file and tls_verify need a TLS URL (rediss:// or valkeys://)")
        if ca_file is not None:
            if not isinstance(ca_file, (str, os.PathLike)) or not os.path.isfile(ca_file):
                raise bad(f"tls_ca_file {ca_file!r} is not a readable file")
            ca_file = os.fspath(ca_file)
        if verify is not None and not isinstance(verify, bool):
            raise bad(f"tls_verify must be a bool; got {verify!r}")
        if scheme == "unix":
            if parts.hostname or not parts.path:
                raise bad("a unix socket URL is unix:///absolute/path (no host)")
            return cls(
                shown, None, 0, unquote(parts.path), db, username, password, False, None, True
            )
        if not parts.hostname:
            raise bad("no host")
        if port is None and re.search(r":\d*$", parts.netloc.rsplit("@", 1)[-1]):
            raise bad("an empty port")
        if port is not None and not 0 < port < 65536:
            raise bad(f"port {port} is out of range (1-65535)")
        return cls(
            shown,
            parts.hostname,
            DEFAULT_PORT if port is None else port,
            None,
            db,
            username,
            password,
            tls,
            ca_file,
            True if verify is None else verify,
        )


def _db(option: str | None, path: str, bad: _Complaint) -> int:
    text = path.strip("/")
    if option is not None:
        if text:
            raise bad("the database is given twice (path and ?db=)")
        text = option
    if not text:
        return 0
    if not text.isdigit() or len(text) > 7 or int(text) >= MAX_DB:
        raise bad(f"the database must be a number (0, 1, ...); got {text!r}")
    return int(text)


def _flag(value: str | None, bad: _Complaint) -> bool | None:
    if value is None:
        return None
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise bad(f"tls_verify must be yes or no; got {value!r}")


def redact(url: object) -> str:
    """``url`` with the password (everything between the user's colon and the last ``@``
    of the authority) replaced by ``***``; a URL with no password is returned as it is.

    Works on text that does not parse as a URL too: it is what error messages show.
    """
    if not isinstance(url, str):
        return repr(url)
    scheme_end = url.find("://")
    if scheme_end < 0:
        # No authority to find: whatever precedes an @ may be a password.
        at = url.rfind("@")
        return url if at < 0 else "***" + url[at:]
    start = scheme_end + 3
    # The authority ends at the first / after the last @ (a password may hold / or ?).
    at = url.rfind("@", start)
    if at < 0:
        return url
    userinfo = url[start:at]
    user, colon, _ = userinfo.partition(":")
    hidden = f"{user}:***" if colon else "***"
    return url[:start] + hidden + url[at:]
