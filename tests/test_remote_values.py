"""The remote value formats on their own (no server): a value is accepted only as it was
framed, under its key and namespace (and, sealed, its tenant's secret); every single-bit flip,
every truncation and every extension of a framed value is refused; keys encode injectively;
without the secret nobody can make a sealed value that is accepted.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.tiers.values import (
    HEADER_BYTES,
    MIN_SECRET_BYTES,
    SEALED_HEADER_BYTES,
    SEALED_MAGIC,
    Namespace,
    Rejection,
    ValueFormat,
    encode_key,
    frame,
    payload_of,
    value_format,
)
from kvoffload_spec.errors import InvalidArgumentError

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


# -- sealed values (a secret) ---------------------------------------------------------------

SECRET = b"tenant-a secret, 32 bytes long.."
SEALED = value_format(NAMESPACE, SECRET)
OTHER_TENANT = value_format(NAMESPACE, b"tenant-b secret, 32 bytes long..")


@given(keys, st.binary(max_size=300))
def test_a_sealed_value_reads_back_exactly_and_only_for_its_tenant(
    key: Hashable, payload: bytes
) -> None:
    encoded = encode_key(key)
    value = SEALED.frame(encoded, memoryview(payload))
    assert (
        len(value)
        == SEALED_HEADER_BYTES + len(payload)
        == SEALED.header_bytes(encoded) + len(payload)
    )
    found = SEALED.payload_of(encoded, value)
    assert isinstance(found, memoryview) and found.tobytes() == payload
    assert OTHER_TENANT.payload_of(encoded, value) is Rejection.FOREIGN
    assert value_format(NAMESPACE).payload_of(encoded, value) is Rejection.FOREIGN
    assert value_format(OTHER, SECRET).payload_of(encoded, value) is Rejection.FOREIGN


@given(keys, keys, st.binary(max_size=64))
def test_a_sealed_value_moved_to_another_key_fails_its_tag(
    one: Hashable, two: Hashable, payload: bytes
) -> None:
    if one != two:
        value = SEALED.frame(encode_key(one), memoryview(payload))
        assert SEALED.payload_of(encode_key(two), value) is Rejection.MAC
        assert SEALED.server_key(encode_key(one)) != SEALED.server_key(encode_key(two))


@settings(max_examples=40)  # each example tries every bit of its value
@given(keys, st.binary(min_size=1, max_size=40))
def test_every_bit_flip_truncation_and_extension_of_a_sealed_value_is_refused(
    key: Hashable, payload: bytes
) -> None:
    encoded = encode_key(key)
    value = SEALED.frame(encoded, memoryview(payload))
    for position in range(len(value)):
        for bit in range(8):
            flipped = bytearray(value)
            flipped[position] ^= 1 << bit
            assert isinstance(SEALED.payload_of(encoded, bytes(flipped)), Rejection)
    for length in range(len(value)):
        assert isinstance(SEALED.payload_of(encoded, value[:length]), Rejection), length
    for extra in (b"\0", b"x" * 7):
        assert SEALED.payload_of(encoded, value + extra) is Rejection.LENGTH


def test_a_forger_who_knows_everything_but_the_secret_is_refused() -> None:
    """Everything public about the tenant (its namespace, the format, a value it stored, the
    server key it used) does not let a writer without the secret make a value it accepts."""
    encoded = encode_key(b"block hash")
    genuine = SEALED.frame(encoded, memoryview(b"the real KV bytes"))
    tenant = genuine[4:20]  # readable by anyone who can GET the value
    nonce = genuine[28:44]
    fake = b"attacker's KV bytes"
    forgeries = [
        value_format(NAMESPACE).frame(encoded, memoryview(fake)),  # the plain format
        OTHER_TENANT.frame(encoded, memoryview(fake)),  # sealed with the forger's own secret
        # the genuine header, another payload of the same length and of another length
        genuine[:SEALED_HEADER_BYTES] + b"attacker's KV byte",
        genuine[:20] + len(fake).to_bytes(8, "little") + genuine[28:SEALED_HEADER_BYTES] + fake,
        # a header assembled from the public fields with a tag guessed as zeros
        SEALED_MAGIC + tenant + len(fake).to_bytes(8, "little") + nonce + bytes(16) + fake,
    ]
    for forged in forgeries:
        assert isinstance(SEALED.payload_of(encoded, forged), Rejection), forged


def test_server_keys_depend_on_the_secret_and_tell_nothing_of_the_block_key() -> None:
    encoded = encode_key(b"a prefix hash")
    name = SEALED.server_key(encoded)
    assert name.startswith(SEALED.key_prefix) and name.startswith(b"kvo2:")
    assert encoded not in name and NAMESPACE.fingerprint.hex().encode() not in name
    assert OTHER_TENANT.server_key(encoded) != name
    assert value_format(NAMESPACE, SECRET).server_key(encoded) == name  # same in every process
    assert value_format(NAMESPACE).server_key(encoded) == NAMESPACE.key_prefix + encoded


def test_a_secret_is_checked_and_never_shown() -> None:
    for short in (b"", "too short", b"x" * (MIN_SECRET_BYTES - 1)):
        with pytest.raises(InvalidArgumentError, match="at least"):
            value_format(NAMESPACE, short)
    with pytest.raises(InvalidArgumentError, match="bytes or a str"):
        value_format(NAMESPACE, 12345678901234567890)  # type: ignore[arg-type]
    # a secret file's trailing newline is not part of the secret
    text = SECRET.decode()
    assert value_format(NAMESPACE, text + "\n").server_key(b"k") == SEALED.server_key(b"k")
    assert SECRET.decode() not in repr(SEALED) and "secret" not in repr(SEALED)


def _recording_tags(
    monkeypatch: pytest.MonkeyPatch, sealed: ValueFormat
) -> list[tuple[int, bytes]]:
    """Every (writer key, nonce) ``sealed`` tags or checks under, in order."""
    real = sealed._tag  # type: ignore[attr-defined]
    used: list[tuple[int, bytes]] = []

    def recording(
        cipher: object, nonce: bytes, fixed: bytes, encoded_key: bytes, payload: memoryview
    ) -> bytes:
        assert isinstance(payload, memoryview)  # a view, not a copy
        used.append((id(cipher), bytes(nonce)))
        tag: bytes = real(cipher, nonce, fixed, encoded_key, payload)
        return tag

    monkeypatch.setattr(sealed, "_tag", recording)
    return used


def test_no_two_sealed_values_share_a_writer_key_and_nonce(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GCM's tag is a one-time MAC: two messages tagged under one key and nonce give the
    authentication key away, and forgeries with it. Each writer counts its values, so 64
    seals of the same bytes under the same block key use 64 nonces, and a read checks each
    value under the writer key and nonce it was sealed with; the payload goes to the MAC as
    the caller's buffer."""
    sealed = value_format(NAMESPACE, SECRET)
    used = _recording_tags(monkeypatch, sealed)
    encoded = encode_key(b"one block")
    values = [sealed.frame(encoded, memoryview(b"the same bytes")) for _ in range(64)]
    sealing = list(used)
    assert len(set(sealing)) == 64
    used.clear()
    assert all(isinstance(sealed.payload_of(encoded, value), memoryview) for value in values)
    assert used == sealing
    # The tag binds the block key: read under another key, the same nonce fails.
    assert sealed.payload_of(encode_key(b"another block"), values[0]) is Rejection.MAC


def test_two_writers_of_one_secret_draw_their_own_keys_and_read_each_other() -> None:
    first, second = value_format(NAMESPACE, SECRET), value_format(NAMESPACE, SECRET)
    encoded = encode_key(b"shared block")
    by_first = first.frame(encoded, memoryview(b"bytes"))
    by_second = second.frame(encoded, memoryview(b"bytes"))
    writer_id = slice(28, 38)
    assert by_first[writer_id] != by_second[writer_id]
    assert bytes(cast(memoryview, second.payload_of(encoded, by_first))) == b"bytes"
    assert bytes(cast(memoryview, first.payload_of(encoded, by_second))) == b"bytes"


def test_a_writer_whose_counter_runs_out_draws_a_new_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvoffload.tiers import values

    monkeypatch.setattr(values, "_COUNTER_END", 3)
    sealed = value_format(NAMESPACE, SECRET)
    encoded = encode_key(7)
    framed = [sealed.frame(encoded, memoryview(b"x")) for _ in range(7)]
    headers = {(value[28:38], value[38:44]) for value in framed}
    assert len(headers) == 7
    assert len({writer for writer, _ in headers}) == 3
    assert all(bytes(cast(memoryview, sealed.payload_of(encoded, v))) == b"x" for v in framed)


def test_a_key_may_nest_tuples_eight_deep_and_no_deeper() -> None:
    key: Hashable = 1
    for _ in range(8):
        key = (key,)
    assert encode_key(key)
    with pytest.raises(InvalidArgumentError, match="more than 8 deep"):
        encode_key((key,))


class _Index(int):
    """An int subclass: encode_key's fast path for exact ints does not take it."""


def _slow_path_twin(key: Hashable) -> Hashable:
    if type(key) is int:
        return _Index(key)
    if isinstance(key, tuple):
        return tuple(_slow_path_twin(part) for part in key)
    return key


_KEYS = st.recursive(
    st.integers(min_value=-(2**80), max_value=2**80) | st.text(max_size=3) | st.binary(max_size=3),
    lambda inner: st.tuples(inner, inner) | st.tuples(inner),
    max_leaves=6,
)


@given(_KEYS)
@settings(max_examples=300, deadline=None)
def test_the_fast_path_for_ints_encodes_as_the_general_one(key: Hashable) -> None:
    assert encode_key(key) == encode_key(_slow_path_twin(key))
