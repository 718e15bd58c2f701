"""The product's value formats (``kvoffload.tiers.values``: ``PlainFormat``, ``SealedFormat``)
decide as the spec's rules (``kvoffload_spec.tiers.TierRules``) do, on every value the spec's
others can plant.

Each spec term is made into real bytes with drawn namespaces, secrets, block keys and
payloads: a value is framed by the format of the tenant that made it (a torn one cut short
after framing; one with a copied tag framed over the bytes its tag covers, then given the
forger's payload). Then every reader, for every key, must accept exactly the values the spec
accepts, and get back exactly their bytes; and two server keys are equal exactly when the
spec's are.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.tiers.values import (
    SEALED_HEADER_BYTES,
    Namespace,
    ValueFormat,
    encode_key,
    value_format,
)
from kvoffload_spec.tiers import (
    ACCIDENTS,
    ADVERSARY,
    FULL,
    NO_SECRET,
    TENANTS,
    Stored,
    Tenant,
    TierRules,
    Value,
    plantable,
)

KEYS = ("a", "b")
TENANCIES = (ACCIDENTS, TENANTS, NO_SECRET)
READERS = tuple(
    dict.fromkeys(
        [tenant for tenancy in TENANCIES for tenant in (tenancy.tenant, *tenancy.others)]
        + [ADVERSARY]
    )
)
SECRETS = sorted({tenant.secret for tenant in READERS if tenant.secret is not None})
RULES = TierRules()


@dataclass(frozen=True)
class Concrete:
    """What the spec's symbols stand for in one example."""

    namespaces: dict[int, Namespace]
    secrets: dict[str, str]
    keys: dict[Hashable, bytes]  # spec key -> encoded block key
    payloads: dict[tuple[Hashable, int], bytes]  # (key, namespace) -> its KV bytes
    flip: int  # where the forger changes a byte
    cut: int  # how many bytes a torn value loses

    def format(self, tenant: Tenant) -> ValueFormat:
        secret = None if tenant.secret is None else self.secrets[tenant.secret]
        return value_format(self.namespaces[tenant.namespace], secret)

    def payload(self, value: Value) -> bytes:
        payload = bytearray(self.payloads[value.owner, value.namespace])
        if value.forged:
            payload[self.flip % len(payload)] ^= 0xFF
        if value.length < FULL:
            del payload[len(payload) - min(self.cut, len(payload)) :]
        return bytes(payload)

    def bytes_of(self, stored: Stored) -> bytes:
        value, tag = stored.value, stored.tag
        whole = Value(value.owner, FULL, value.namespace, value.forged)
        if tag is None:
            plain = self.format(Tenant("plain", value.namespace))
            framed = plain.frame(self.keys[value.owner], memoryview(self.payload(whole)))
            return framed[: len(framed) - len(self.payload(whole)) + len(self.payload(value))]
        assert tag.namespace is not None and tag.key is not None  # the spec's own rules
        sealer = self.format(Tenant("sealer", tag.namespace, tag.secret))
        framed = sealer.frame(self.keys[tag.key], memoryview(self.payload(tag.value)))
        return framed[:SEALED_HEADER_BYTES] + self.payload(value)


namespace_texts = st.text(min_size=1, max_size=12).filter(lambda text: text != "{}")
block_keys = st.one_of(st.integers(), st.binary(max_size=40), st.text(max_size=12))


@st.composite
def concretes(draw: st.DrawFn) -> Concrete:
    texts = draw(st.lists(namespace_texts, min_size=2, max_size=2, unique=True))
    secrets = draw(
        st.lists(
            st.binary(min_size=16, max_size=24).map(bytes.hex),
            min_size=len(SECRETS),
            max_size=len(SECRETS),
            unique=True,
        )
    )
    keys = draw(st.lists(block_keys, min_size=2, max_size=2, unique_by=encode_key))
    payloads: dict[tuple[Hashable, int], bytes] = {
        (key, namespace): draw(st.binary(min_size=1, max_size=64))
        for key in KEYS
        for namespace in range(2)
    }
    return Concrete(
        {n: Namespace.of(text) for n, text in enumerate(texts)},
        dict(zip(SECRETS, secrets, strict=True)),
        {key: encode_key(real) for key, real in zip(KEYS, keys, strict=True)},
        payloads,
        draw(st.integers(0, 63)),
        draw(st.integers(1, 64)),
    )


def every_plantable_value() -> list[Stored]:
    values = [
        stored
        for tenancy in TENANCIES
        for key in KEYS
        for stored in plantable(tenancy, RULES, key, KEYS)
    ]
    return list(dict.fromkeys(values))


PLANTABLE = every_plantable_value()


@settings(max_examples=40, deadline=None)
@given(concretes())
def test_the_formats_accept_exactly_what_the_spec_accepts(world: Concrete) -> None:
    real = {stored: world.bytes_of(stored) for stored in PLANTABLE}
    accepted = 0
    for reader in READERS:
        fmt = world.format(reader)
        for key in KEYS:
            for stored in PLANTABLE:
                expected = RULES.accept(reader, key, stored)
                found = fmt.payload_of(world.keys[key], real[stored])
                assert isinstance(found, memoryview) == expected, (reader, key, stored, found)
                if isinstance(found, memoryview):
                    assert found.tobytes() == world.payload(stored.value)
                    accepted += 1
    # Each tenant accepts its own value of each key; A without a secret, also the forgeries.
    assert accepted == len(READERS) * len(KEYS) + len(KEYS)


@settings(max_examples=40, deadline=None)
@given(concretes())
def test_server_keys_are_equal_exactly_when_the_spec_says_so(world: Concrete) -> None:
    names = [
        (RULES.server_key(t, k), world.format(t).server_key(world.keys[k]))
        for t in READERS
        for k in KEYS
    ]
    for spec_one, real_one in names:
        for spec_two, real_two in names:
            assert (spec_one == spec_two) == (real_one == real_two)
        if spec_one.secret is None:  # the spec's public name: made of public data only
            namespace = world.namespaces[spec_one.namespace]
            assert real_one == namespace.key_prefix + world.keys[spec_one.key]
