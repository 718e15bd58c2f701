"""The remote value format on its own (no server): a value is accepted only as it was framed,
under its key and namespace; every single-bit flip, every truncation and every extension of
a framed value is refused; keys encode injectively.
"""

from __future__ import annotations

from collections.abc import Hashable

from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.tiers.values import (
    HEADER_BYTES,
    Namespace,
    Rejection,
    encode_key,
    frame,
    payload_of,
)

NAMESPACE = Namespace.of({"model": "m", "layers": 2})
OTHER = Namespace.of({"model": "m", "layers": 3})

atoms = st.one_of(st.integers(), st.text(max_size=8), st.binary(max_size=8))
keys = st.recursive(atoms, lambda inner: st.tuples(inner, inner) | st.tuples(inner), max_leaves=6)


@given(keys, st.binary(max_size=300))
def test_a_framed_value_reads_back_exactly(key: Hashable, payload: bytes) -> None:
    encoded = encode_key(key)
    value = frame(NAMESPACE, encoded, memoryview(payload))
    assert len(value) == HEADER_BYTES + len(encoded) + len(payload)
    found = payload_of(NAMESPACE, encoded, value)
    assert isinstance(found, memoryview) and found.tobytes() == payload
    assert payload_of(OTHER, encoded, value) is Rejection.FOREIGN


@given(keys, keys, st.binary(max_size=64))
def test_keys_encode_injectively_and_a_value_stays_with_its_key(
    one: Hashable, two: Hashable, payload: bytes
) -> None:
    assert (encode_key(one) == encode_key(two)) == (one == two)
    if one != two:
        value = frame(NAMESPACE, encode_key(one), memoryview(payload))
        assert payload_of(NAMESPACE, encode_key(two), value) is Rejection.WRONG_KEY


@settings(max_examples=60)  # each example tries every bit of its value
@given(keys, st.binary(min_size=1, max_size=48))
def test_every_bit_flip_truncation_and_extension_is_refused(key: Hashable, payload: bytes) -> None:
    encoded = encode_key(key)
    value = frame(NAMESPACE, encoded, memoryview(payload))
    for position in range(len(value)):
        for bit in range(8):
            flipped = bytearray(value)
            flipped[position] ^= 1 << bit
            assert isinstance(payload_of(NAMESPACE, encoded, bytes(flipped)), Rejection), (
                position,
                bit,
            )
    for length in range(len(value)):
        assert isinstance(payload_of(NAMESPACE, encoded, value[:length]), Rejection), length
    for extra in (b"\0", b"x" * 7):
        assert payload_of(NAMESPACE, encoded, value + extra) is Rejection.LENGTH
