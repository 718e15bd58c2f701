"""docs/remote.md's least-privilege recipe on a real server: an ACL file with the default
user off, an admin, and one user per tenant limited to its key prefix and the commands a
store sends, exactly the lines the page gives (its placeholders filled in).

Each tenant runs every store operation (put, get, get_into, contains, delete, ping, stats)
with no failure, from engines of two namespaces (one prefix per secret covers them all),
and is refused what it has no business doing: the other tenant's keys (with the plain
client, and through a store that computes the other tenant's names), SCAN, KEYS, FLUSHALL,
CONFIG, and any write outside its prefix.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import valkey

from kvoffload.tiers import ValkeyStore, acl_rule
from tests.remote_support import LAYOUT, blocks
from tests.valkey_server import ValkeyServer

DOC = Path(__file__).resolve().parent.parent / "docs" / "remote.md"
SECRETS = {
    "tenant-a": b"tenant A's secret: 32 bytes long",
    "tenant-b": b"tenant B's secret: 32 bytes long",
}
PASSWORDS = {"tenant-a": "password-of-tenant-a", "tenant-b": "password-of-tenant-b"}
ADMIN_PASSWORD = "password-of-the-admin"
BLOCK = 4096


def prefix_of(tenant: str) -> str:
    # No connection is made by a constructor: the prefix is computed from secret alone.
    store = ValkeyStore("redis://127.0.0.1:1/0", namespace=LAYOUT, secret=SECRETS[tenant])
    return store.key_prefix


def documented_acl() -> list[str]:
    """The ACL file of the page's recipe, its placeholders filled in for this test."""
    text = DOC.read_text(encoding="utf-8")
    block = re.search(r"```text\n(user default off\n.*?)```", text, re.S)
    assert block, "docs/remote.md has no ACL file starting with 'user default off'"
    lines = []
    for line in block.group(1).splitlines():
        line = line.replace("<admin password>", ADMIN_PASSWORD)
        for tenant in SECRETS:
            if line.startswith(f"user {tenant} "):
                digest = hashlib.sha256(PASSWORDS[tenant].encode()).hexdigest()
                line = line.replace(f"<SHA-256 of {tenant}'s password>", digest)
                line = line.replace(f"<{tenant}'s key prefix>", prefix_of(tenant))
        assert "<" not in line, f"a placeholder the test does not fill: {line}"
        lines.append(line)
    return lines


@pytest.fixture
def acl_server(tmp_path: Path) -> Iterator[ValkeyServer]:
    aclfile = tmp_path / "users.acl"
    aclfile.write_text("\n".join(documented_acl()) + "\n", encoding="utf-8")
    with ValkeyServer(aclfile=str(aclfile)) as server:
        yield server


def url(server: ValkeyServer, tenant: str) -> str:
    return f"redis://{tenant}:{PASSWORDS[tenant]}@127.0.0.1:{server.port}/0"


def client(server: ValkeyServer, tenant: str) -> valkey.Valkey:
    return valkey.Valkey.from_url(url(server, tenant))


def test_the_pages_tenant_lines_are_what_acl_rule_makes() -> None:
    """The documented lines are the library's own (``acl_rule``), in the ACL-file form."""
    for tenant in SECRETS:
        made = acl_rule(tenant, PASSWORDS[tenant], prefix_of(tenant))
        assert made.startswith("ACL SETUSER ")
        assert "user " + made.removeprefix("ACL SETUSER ") in documented_acl()


def test_each_tenant_runs_every_operation_and_is_refused_everything_else(
    acl_server: ValkeyServer,
) -> None:
    admin = valkey.Valkey.from_url(f"redis://admin:{ADMIN_PASSWORD}@127.0.0.1:{acl_server.port}/0")
    with pytest.raises(valkey.AuthenticationError):  # the default user is off
        valkey.Valkey.from_url(acl_server.url).ping()
    keys = [("prefix", i) for i in range(6)]
    for tenant in SECRETS:
        values = blocks(len(keys), BLOCK, seed=len(tenant))
        # Two namespaces (tensor-parallel ranks) of one tenant: one prefix covers both.
        for rank in (0, 1):
            store = ValkeyStore(
                url(acl_server, tenant),
                namespace={**LAYOUT, "tp_rank": rank},
                secret=SECRETS[tenant],
                timeout_s=10,
            )
            assert store.ping()
            assert store.put(keys, values) == [True] * len(keys)
            assert [v and v.tobytes() for v in store.get(keys)] == values
            buffers = [bytearray(BLOCK) for _ in keys]
            assert store.get_into(keys, buffers) == [True] * len(keys)
            assert [bytes(b) for b in buffers] == values
            assert store.contains(keys) == [True] * len(keys)
            assert store.delete(keys[:2]) == [True, True]
            assert store.contains(keys[:3]) == [False, False, True]
            stats = store.stats()
            assert stats.failures == 0 and stats.rejected == 0, stats.last_error
            store.close()
    names = {tenant: sorted(admin.scan_iter(match=prefix_of(tenant) + "*")) for tenant in SECRETS}
    assert len(names["tenant-a"]) == len(names["tenant-b"]) == 2 * (len(keys) - 2)
    a = client(acl_server, "tenant-a")
    own = a.mget([names["tenant-a"][0]])  # its own keys, with the commands of a store
    assert isinstance(own, list) and own[0]
    theirs = names["tenant-b"][0]
    refused: list[Callable[[], object]] = [
        lambda: a.get(theirs),
        lambda: a.mget([names["tenant-a"][0], theirs]),
        lambda: a.set(theirs, b"garbage"),
        lambda: a.unlink(theirs),
        lambda: a.exists(theirs),
        lambda: a.set("kvo1:anything", b"outside any prefix"),
        lambda: a.scan(),
        lambda: a.keys("*"),
        lambda: a.flushall(),
        lambda: a.flushdb(),
        lambda: a.config_get("*"),
        lambda: a.execute_command("ACL", "LIST"),  # type: ignore[no-untyped-call]
        lambda: a.execute_command("CLIENT", "LIST"),  # type: ignore[no-untyped-call]
    ]
    for attempt in refused:
        with pytest.raises(valkey.exceptions.NoPermissionError):
            attempt()
    assert admin.dbsize() == 4 * (len(keys) - 2)  # nothing of B's was changed
    # A store of tenant A's user that computes tenant B's names (it holds B's secret by
    # mistake): every call is refused by the server, counted, and raises nothing.
    confused = ValkeyStore(url(acl_server, "tenant-a"), namespace={**LAYOUT, "tp_rank": 0},
                           secret=SECRETS["tenant-b"], timeout_s=10, retry_after_s=0)  # fmt: skip
    assert confused.get(keys[2:]) == [None] * (len(keys) - 2)
    assert confused.put(keys[2:3], [b"x" * BLOCK]) == [False]
    assert confused.delete(keys[2:3]) == [False]
    stats = confused.stats()
    assert stats.server_errors >= 3 and stats.hits == 0
    assert "NOPERM" in (stats.last_error or "")
    assert admin.dbsize() == 4 * (len(keys) - 2)
