"""How a block is written to a remote store: its server key, and a self-checking value.

A remote server is shared and adversarial: other engines write to it, it evicts keys at will,
it restarts empty, a bug elsewhere can write anything under any key. So every value carries
what is needed to refuse it unless it is exactly what this engine stored under this key:

    offset  size  field
    0       4     magic b"KVO\\x01" (format and its version)
    4       16    namespace fingerprint (model + KV layout, :class:`Namespace`)
    20      4     encoded key length K, unsigned little-endian
    24      8     payload length N, unsigned little-endian
    32      8     checksum: XXH3-64 of the payload, seeded with the XXH3-64 of bytes 0-31
                  and the key (so it covers all three)
    40      K     the encoded block key
    40 + K  N     the payload (the block's bytes)

A value is accepted only if every field matches: the magic, this namespace's fingerprint,
this very key, a payload of exactly N bytes (so a truncated or over-long value is refused)
and the checksum (a flipped bit anywhere is refused). Anything else is a miss, counted by
its reason (:class:`Rejection`).

The server key is ``kvo1:<fingerprint hex>:<encoded key>``: two models or two layouts never
read or overwrite each other's blocks, even on one server.
"""

from __future__ import annotations

import enum
import hashlib
import json
import operator
import struct
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import SupportsIndex, cast

import xxhash

from kvoffload_spec.errors import InvalidArgumentError

MAGIC = b"KVO\x01"
_FIXED = struct.Struct("<4s16sIQ")  # magic, fingerprint, key length, payload length
_CHECKSUM = struct.Struct("<Q")
HEADER_BYTES = _FIXED.size + _CHECKSUM.size  # 40, before the key
FINGERPRINT_BYTES = 16
# Keys are block hashes in practice (32 bytes in vLLM); a bound keeps headers small.
MAX_KEY_BYTES = 4096
# Valkey and Redis refuse a bulk string over 512 MiB (proto-max-bulk-len).
MAX_VALUE_BYTES = 512 * 1024 * 1024
KEY_PREFIX = b"kvo1:"


class Rejection(enum.Enum):
    """Why a value read from the server was refused (each one is a miss to the caller)."""

    MALFORMED = "malformed"  # shorter than a header, or not a string
    FOREIGN = "foreign"  # another format version or another namespace
    WRONG_KEY = "wrong_key"  # a value stored under another key
    LENGTH = "length"  # truncated or extended: the payload is not the length stored
    CHECKSUM = "checksum"  # a byte changed somewhere


@dataclass(frozen=True)
class Namespace:
    """The model and KV layout whose blocks a store holds, hashed into a fingerprint.

    Build it with :meth:`of` from a description that changes whenever the bytes of a block
    would: the model (name and revision), dtype, tokens per block, layer count, the layout's
    shapes and bytes per block, tensor-parallel rank... Two engines share blocks exactly when
    their descriptions are equal.
    """

    description: str  # canonical JSON (or the caller's string)
    fingerprint: bytes  # 16 bytes

    @classmethod
    def of(cls, description: str | Mapping[str, object] | Namespace) -> Namespace:
        if isinstance(description, Namespace):
            return description
        if isinstance(description, str):
            text = description
        elif isinstance(description, Mapping):
            try:
                text = json.dumps(
                    description,
                    sort_keys=True,
                    separators=(",", ":"),
                    ensure_ascii=False,
                    allow_nan=False,
                )
            except (TypeError, ValueError) as error:
                raise InvalidArgumentError(
                    f"a namespace description must be JSON (str, int, float, bool, None, "
                    f"lists and str-keyed mappings of them): {error}"
                ) from None
        else:
            raise InvalidArgumentError(
                "namespace must be a str, a mapping describing the model and KV layout, or a "
                f"Namespace; got {type(description).__name__}"
            )
        if not text or text == "{}":
            raise InvalidArgumentError(
                "namespace must describe the model and KV layout: an empty one would let "
                "every engine read every other engine's blocks"
            )
        digest = hashlib.blake2b(
            text.encode("utf-8", "surrogatepass"),
            digest_size=FINGERPRINT_BYTES,
            person=b"kvoffload-ns",
        ).digest()
        return cls(text, digest)

    @property
    def key_prefix(self) -> bytes:
        return KEY_PREFIX + self.fingerprint.hex().encode("ascii") + b":"


def encode_key(key: Hashable) -> bytes:
    """The block key as bytes, the same in every process (``hash()`` of a str is not).

    Keys are ints (or anything with ``__index__``), str, bytes, or tuples of these; each is
    tagged with its type, so ``1``, ``"1"`` and ``b"1"`` are three keys. ``True`` is ``1``,
    as in a dict.
    """
    encoded = _encode(key, depth=0)
    if len(encoded) > MAX_KEY_BYTES:
        raise InvalidArgumentError(
            f"a remote key encodes to {len(encoded)} bytes, more than {MAX_KEY_BYTES}"
        )
    return encoded


def _encode(key: object, depth: int) -> bytes:
    if isinstance(key, bytes):
        return b"b" + key
    if isinstance(key, str):
        return b"s" + key.encode("utf-8", "surrogatepass")
    if isinstance(key, tuple):
        if depth >= 8:
            raise InvalidArgumentError("a remote key nests tuples more than 8 deep")
        parts = [_encode(part, depth + 1) for part in key]
        return b"t" + b"".join(b"%d:%s" % (len(part), part) for part in parts)
    if hasattr(type(key), "__index__"):
        return b"i%d" % operator.index(cast(SupportsIndex, key))
    raise InvalidArgumentError(
        "a remote block key must be an int, str, bytes or a tuple of them; "
        f"got {type(key).__name__}"
    )


def header(namespace: Namespace, encoded_key: bytes, payload: memoryview) -> bytes:
    """The bytes that precede ``payload`` in the stored value (the payload is not copied)."""
    fixed = _FIXED.pack(MAGIC, namespace.fingerprint, len(encoded_key), payload.nbytes)
    return fixed + _CHECKSUM.pack(_checksum(fixed, encoded_key, payload)) + encoded_key


def _checksum(fixed: bytes | memoryview, encoded_key: bytes, payload: memoryview) -> int:
    # One-shot calls: a hasher object and its updates cost more than hashing 64 KiB.
    return xxhash.xxh3_64_intdigest(payload, xxhash.xxh3_64_intdigest(bytes(fixed) + encoded_key))


def frame(namespace: Namespace, encoded_key: bytes, payload: memoryview) -> bytes:
    """The whole stored value in one buffer (a copy: the stores send header and payload
    separately instead; this is for tests and tools)."""
    return header(namespace, encoded_key, payload) + payload.tobytes()


def payload_of(namespace: Namespace, encoded_key: bytes, value: object) -> memoryview | Rejection:
    """The payload of ``value`` read under ``encoded_key``, a view into it (no copy), or why
    it must be refused."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        return Rejection.MALFORMED
    view = memoryview(value).cast("B") if isinstance(value, memoryview) else memoryview(value)
    if view.nbytes < HEADER_BYTES:
        return Rejection.MALFORMED
    magic, fingerprint, key_length, payload_length = _FIXED.unpack_from(view)
    if magic != MAGIC or fingerprint != namespace.fingerprint:
        return Rejection.FOREIGN
    start = HEADER_BYTES + key_length
    if key_length != len(encoded_key) or view[HEADER_BYTES:start] != encoded_key:
        return Rejection.WRONG_KEY
    if view.nbytes - start != payload_length:
        return Rejection.LENGTH
    payload = view[start:]
    (stored,) = _CHECKSUM.unpack_from(view, _FIXED.size)
    if _checksum(view[: _FIXED.size], encoded_key, payload) != stored:
        return Rejection.CHECKSUM
    return payload


def as_payload(value: object, what: str) -> memoryview:
    """``value`` (any C-contiguous buffer: bytes, bytearray, memoryview, numpy array...) as a
    flat byte view, without copying it."""
    try:
        view = memoryview(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(
            f"{what} must support the buffer protocol (bytes, bytearray, memoryview, a numpy "
            f"array...); got {type(value).__name__}"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgumentError(f"{what} must be C-contiguous")
    flat = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if flat.nbytes + HEADER_BYTES + MAX_KEY_BYTES > MAX_VALUE_BYTES:
        raise InvalidArgumentError(
            f"{what} holds {flat.nbytes} bytes; a value must stay under {MAX_VALUE_BYTES}"
        )
    return flat
