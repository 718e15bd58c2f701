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

That format protects against accidents, not against a writer who means harm: every field is
public (the fingerprint is in every server key, the checksum is unkeyed), so anyone who can
write to the server can build a value this engine accepts. With a **secret** (shared by the
engines of one tenant, unknown to everyone else) values are *sealed* instead
(:class:`SealedFormat`):

    offset  size  field
    0       4     magic b"KVO\x03"
    4       16    tenant id: keyed BLAKE2b of the namespace fingerprint (secret-derived key)
    20      8     payload length N, unsigned little-endian
    28      10    writer id, random per writing store (and renewed every 2**48 values)
    38      6     the writer's value counter, unsigned little-endian
    44      16    tag: AES-256-GCM under the writer's key (keyed BLAKE2b of the writer id,
                  secret-derived key), nonce = the counter, the payload as associated data
                  and bytes 0-43, the encoded block key's length and the key as the
                  plaintext; the ciphertext is thrown away, only the tag is kept
    60      N     the payload

and the server key is ``kvo2:<owner id hex>:<keyed BLAKE2b of the namespace fingerprint and
the encoded key, hex>``, the owner id a keyed hash of the secret alone: every key of one
secret, whatever its namespace (model, layout, tensor-parallel rank), starts with the same
prefix, so that one ACL pattern (``~kvo2:<owner id>:*``) gives a tenant its keys and nothing
else. So without the secret nobody can make a value this tenant accepts (a forgery, a bit
flip, a value moved from another key or copied from another tenant all fail the tag), nor
compute the server key of a candidate prefix to learn whether it is cached. The block key itself is
not stored in a sealed value (it would tell a reader which prefixes are cached): the tag
covers it, so a value read under another key fails the tag.

Why this construction: the tag must cost little next to moving the bytes (a put or a get
runs at 1-3 GB/s here, and the machine's two cores are shared with the server). Measured
here over one block (``bench/remote_bench.py``): AES-GMAC 17-21 GB/s, Poly1305 7 (64 KiB)
to 13 GB/s (2 MiB), HMAC-SHA256 1.7-1.8, keyed BLAKE2b 0.6-0.9. With Poly1305 a sealed put
of 64 KiB blocks ran at 73-78% of a plain one, with GMAC at 80-89%; HMAC or BLAKE2b would
cost more than the transfer itself. GCM's tag, like Poly1305's, must never be made twice
under one key and nonce (two messages tagged so give the authentication key away), so each
writing store draws a writer id of 80 random bits, derives its own key from it, and counts
its values: (writer key, counter) never repeats, however many engines write (two writers
draw the same id with probability n**2 / 2**81 for n writers). A reader derives a writer's
key once and keeps it (a few hundred bytes per writer). So a block key stored twice gets two
tags under two nonces, and changing the header or the block key changes the GCM plaintext,
under which the stored tag fails. The payload, the only large part, goes to the MAC in one
call over the caller's buffer (no copy), and nothing is derived per value: an earlier
version derived a one-time key for each value (a BLAKE2b and a new AES key schedule, about
1.5 us), a quarter of the seal's cost at 64 KiB. AES runs on the CPU's AES instructions
(x86-64's AES-NI and CLMUL, ARMv8's crypto extensions), constant-time; on a CPU without them
it is several times slower.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import itertools
import json
import operator
import os
import struct
import threading
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, SupportsIndex, cast

import xxhash

from kvoffload_spec.errors import InvalidArgumentError

if TYPE_CHECKING:
    from .store import WritableBuffer

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
# An int key of more bits (4,215 digits) could never fit in MAX_KEY_BYTES anyway.
_MAX_INT_BITS = 14_000


class Rejection(enum.Enum):
    """Why a value read from the server was refused (each one is a miss to the caller)."""

    MALFORMED = "malformed"  # shorter than a header, or not a string
    FOREIGN = "foreign"  # another format version or another namespace
    WRONG_KEY = "wrong_key"  # a value stored under another key
    LENGTH = "length"  # truncated or extended: the payload is not the length stored
    CHECKSUM = "checksum"  # a byte changed somewhere
    MAC = "mac"  # a sealed value whose tag does not verify: forged, altered or another key's


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


_SMALL_INT = 1 << 64


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
    # Exact ints first: the keys engines use (ints, tuples of ints) skip the general tests.
    if type(key) is int and -_SMALL_INT < key < _SMALL_INT:
        return b"i%d" % key
    if type(key) is tuple:
        if depth >= 8:
            raise InvalidArgumentError("a remote key nests tuples more than 8 deep")
        pieces = []
        for part in key:
            if type(part) is int and -_SMALL_INT < part < _SMALL_INT:
                encoded = b"i%d" % part
            else:
                encoded = _encode(part, depth + 1)
            pieces.append(b"%d:%s" % (len(encoded), encoded))
        return b"t" + b"".join(pieces)
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
        number = operator.index(cast(SupportsIndex, key))
        # Refused before it is written out: past 4,300 digits Python refuses to (ValueError).
        if number.bit_length() > _MAX_INT_BITS:
            raise InvalidArgumentError(
                f"a remote int key has {number.bit_length()} bits; at most {_MAX_INT_BITS}"
            )
        return b"i%d" % number
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
    start = HEADER_BYTES + len(encoded_key)  # where this key's payload begins
    payload = view[start:]
    rejection = check_split(namespace, encoded_key, view[:start], payload)
    return payload if rejection is None else rejection


def check_split(
    namespace: Namespace, encoded_key: bytes, head: memoryview, payload: memoryview
) -> Rejection | None:
    """Why a value whose header (``head``, perhaps followed by padding) and payload lie in
    two buffers must be refused, or None to accept it: what :func:`payload_of` checks, for a
    reader that put the payload straight where it is needed (a disk tier reading into a CPU
    block)."""
    if head.nbytes < HEADER_BYTES:
        return Rejection.MALFORMED
    magic, fingerprint, key_length, payload_length = _FIXED.unpack_from(head)
    if magic != MAGIC or fingerprint != namespace.fingerprint:
        return Rejection.FOREIGN
    start = HEADER_BYTES + key_length
    if key_length != len(encoded_key) or head[HEADER_BYTES:start] != encoded_key:
        return Rejection.WRONG_KEY
    if payload.nbytes != payload_length:
        return Rejection.LENGTH
    (stored,) = _CHECKSUM.unpack_from(head, _FIXED.size)
    if _checksum(head[: _FIXED.size], encoded_key, payload) != stored:
        return Rejection.CHECKSUM
    return None


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


def put_payloads(values: Sequence[object], count: int) -> list[memoryview]:
    """``put``'s values checked, as flat views (no copy): one per key."""
    if isinstance(values, (str, bytes, bytearray, memoryview)) or not isinstance(values, Sequence):
        raise InvalidArgumentError("values must be a sequence of buffers, one per key")
    if len(values) != count:
        raise InvalidArgumentError(
            f"put got {count} keys and {len(values)} values; give one value per key"
        )
    return [as_payload(value, f"the value for key #{i}") for i, value in enumerate(values)]


def writable_buffers(buffers: Sequence[WritableBuffer], count: int) -> list[memoryview]:
    """``get_into``'s buffers checked, as flat writable views: one per key."""
    if isinstance(buffers, (bytes, bytearray, memoryview)) or not isinstance(buffers, Sequence):
        raise InvalidArgumentError("buffers must be a sequence of buffers, one per key")
    if len(buffers) != count:
        raise InvalidArgumentError(
            f"get_into got {count} keys and {len(buffers)} buffers; give one per key"
        )
    views: list[memoryview] = []
    for i, buffer in enumerate(buffers):
        view = as_payload(buffer, f"buffer #{i}")
        if view.readonly:
            raise InvalidArgumentError(f"buffer #{i} is read-only")
        views.append(view)
    return views


# -- the format a store writes and reads --------------------------------------------------


class ValueFormat:
    """How one store names and frames its values: :class:`PlainFormat` without a secret,
    :class:`SealedFormat` with one (:func:`value_format` picks)."""

    namespace: Namespace
    authenticated: bool
    key_prefix: bytes  # every server key of this format starts with it

    def server_key(self, encoded_key: bytes) -> bytes:
        raise NotImplementedError

    def header_bytes(self, encoded_key: bytes) -> int:
        """How many bytes precede the payload in a value stored under ``encoded_key``."""
        raise NotImplementedError

    def header(self, encoded_key: bytes, payload: memoryview) -> bytes:
        """The bytes that precede ``payload`` in the stored value (the payload not copied)."""
        raise NotImplementedError

    def payload_of(self, encoded_key: bytes, value: object) -> memoryview | Rejection:
        """The payload of ``value`` read under ``encoded_key`` (a view, no copy), or why it
        must be refused."""
        raise NotImplementedError

    def check(self, encoded_key: bytes, head: memoryview, payload: memoryview) -> Rejection | None:
        """Why a value read as two buffers, its header (``head``: at least
        :meth:`header_bytes` long, padding after it ignored) and its payload, must be
        refused, or None to accept it (what :meth:`payload_of` checks)."""
        raise NotImplementedError

    def frame(self, encoded_key: bytes, payload: memoryview) -> bytes:
        """The whole value in one buffer (a copy: for tests and tools)."""
        return self.header(encoded_key, payload) + payload.tobytes()


@dataclass(frozen=True)
class PlainFormat(ValueFormat):
    """The ``KVO\\x01`` format: self-checking against accidents, not against forgery."""

    namespace: Namespace
    authenticated: bool = field(default=False, init=False)

    @property
    def key_prefix(self) -> bytes:  # type: ignore[override]
        return self.namespace.key_prefix

    def server_key(self, encoded_key: bytes) -> bytes:
        return self.namespace.key_prefix + encoded_key

    def header_bytes(self, encoded_key: bytes) -> int:
        return HEADER_BYTES + len(encoded_key)

    def header(self, encoded_key: bytes, payload: memoryview) -> bytes:
        return header(self.namespace, encoded_key, payload)

    def payload_of(self, encoded_key: bytes, value: object) -> memoryview | Rejection:
        return payload_of(self.namespace, encoded_key, value)

    def check(self, encoded_key: bytes, head: memoryview, payload: memoryview) -> Rejection | None:
        return check_split(self.namespace, encoded_key, head, payload)


SEALED_MAGIC = b"KVO\x03"
SEALED_KEY_PREFIX = b"kvo2:"
_SEALED_FIXED = struct.Struct("<4s16sQ10s6s")  # magic, tenant, length, writer, counter
_TAG_BYTES = 16
SEALED_HEADER_BYTES = _SEALED_FIXED.size + _TAG_BYTES  # 60
_WRITER_ID_BYTES = 10
_COUNTER_BYTES = 6
_COUNTER_END = 1 << (8 * _COUNTER_BYTES)
# Keys of writers seen, kept by a reader; past this many (writers come and go), start over.
_KNOWN_WRITERS = 4096
# Shorter secrets are guessable offline from one stolen value (the tag is a test for them).
MIN_SECRET_BYTES = 16


def secret_bytes(secret: bytes | bytearray | str | None) -> bytes | None:
    """``secret`` as bytes (a str is UTF-8; surrounding whitespace, such as the newline at
    the end of a secret file, is not part of it), or ``None`` for no secret."""
    if secret is None:
        return None
    if isinstance(secret, str):
        raw = secret.strip().encode("utf-8")
    elif isinstance(secret, (bytes, bytearray)):
        raw = bytes(secret).strip()
    else:
        raise InvalidArgumentError(
            f"secret must be bytes or a str (or None); got {type(secret).__name__}"
        )
    if len(raw) < MIN_SECRET_BYTES:
        raise InvalidArgumentError(
            f"a secret must hold at least {MIN_SECRET_BYTES} bytes (got {len(raw)}); make one "
            "with: python -c 'import secrets; print(secrets.token_hex(32))'"
        )
    return raw


def _subkey(master: bytes, label: bytes) -> bytes:
    return hashlib.blake2b(label, key=master, digest_size=32, person=b"kvoffload-sub").digest()


class SealedFormat(ValueFormat):
    """The ``KVO\\x02`` format: values and server keys only a holder of the secret can make
    (the module's docstring has the layout and why)."""

    authenticated = True

    def __init__(self, namespace: Namespace, secret: bytes) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError as error:  # pragma: no cover - a dependency of kvoffload[remote]
            raise InvalidArgumentError(
                f"sealed values need the 'cryptography' package (pip install "
                f"'kvoffload[remote]'): {error}"
            ) from None

        self._cipher = AESGCM
        self._writers: dict[bytes, Any] = {}  # writer id -> its AESGCM (a key schedule)
        self._writer_lock = threading.Lock()
        self.namespace = namespace
        master = hashlib.blake2b(secret, digest_size=64, person=b"kvoffload-key").digest()
        self._names_key = _subkey(master, b"server key names")
        self._writer_keys = _subkey(master, b"writer MAC keys")
        self._writer: tuple[bytes, Any, Iterator[int]] = self._new_writer()
        self.tenant_id = hashlib.blake2b(
            namespace.fingerprint, key=_subkey(master, b"tenant id"), digest_size=16
        ).digest()
        # The prefix depends on the secret only, not the namespace: a tenant's engines of
        # several models or ranks share one ACL pattern. The name after it hashes the
        # namespace with the key, so namespaces still never meet.
        owner = _subkey(master, b"server key prefix")[:16].hex().encode("ascii")
        self.key_prefix = SEALED_KEY_PREFIX + owner + b":"

    def __repr__(self) -> str:  # never the secret, nor anything derived from it but the id
        return f"SealedFormat(tenant={self.tenant_id.hex()})"

    def server_key(self, encoded_key: bytes) -> bytes:
        # The fingerprint has a fixed length: (fingerprint, key) splits one way only.
        name = hashlib.blake2b(
            self.namespace.fingerprint + encoded_key, key=self._names_key, digest_size=16
        ).hexdigest()
        return self.key_prefix + name.encode("ascii")

    def header_bytes(self, encoded_key: bytes) -> int:
        return SEALED_HEADER_BYTES

    def header(self, encoded_key: bytes, payload: memoryview) -> bytes:
        writer, cipher, counter = self._writer
        count = next(counter)  # atomic: two threads never draw one count
        if count >= _COUNTER_END:
            with self._writer_lock:
                if self._writer[0] == writer:
                    self._writer = self._new_writer()
            return self.header(encoded_key, payload)
        nonce = count.to_bytes(_COUNTER_BYTES, "little")
        fixed = _SEALED_FIXED.pack(SEALED_MAGIC, self.tenant_id, payload.nbytes, writer, nonce)
        return fixed + self._tag(cipher, nonce, fixed, encoded_key, payload)

    def payload_of(self, encoded_key: bytes, value: object) -> memoryview | Rejection:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            return Rejection.MALFORMED
        view = memoryview(value).cast("B") if isinstance(value, memoryview) else memoryview(value)
        if view.nbytes < SEALED_HEADER_BYTES:
            return Rejection.MALFORMED
        payload = view[SEALED_HEADER_BYTES:]
        rejection = self.check(encoded_key, view[:SEALED_HEADER_BYTES], payload)
        return payload if rejection is None else rejection

    def check(self, encoded_key: bytes, head: memoryview, payload: memoryview) -> Rejection | None:
        if head.nbytes < SEALED_HEADER_BYTES:
            return Rejection.MALFORMED
        magic, tenant, payload_length, writer, nonce = _SEALED_FIXED.unpack_from(head)
        if magic != SEALED_MAGIC or tenant != self.tenant_id:
            return Rejection.FOREIGN
        if payload.nbytes != payload_length:
            return Rejection.LENGTH
        fixed = head[: _SEALED_FIXED.size]
        expected = self._tag(self._writer_cipher(writer), nonce, fixed, encoded_key, payload)
        if not hmac.compare_digest(expected, head[_SEALED_FIXED.size : SEALED_HEADER_BYTES]):
            return Rejection.MAC
        return None

    def _new_writer(self) -> tuple[bytes, Any, Iterator[int]]:
        writer = os.urandom(_WRITER_ID_BYTES)
        return writer, self._writer_cipher(writer), itertools.count()

    def _writer_cipher(self, writer: bytes) -> Any:
        cipher = self._writers.get(writer)
        if cipher is None:
            # Anyone can put any writer id in a value: the cache is bounded, and a value
            # under an unknown id costs one key schedule, like any other value checked.
            if len(self._writers) >= _KNOWN_WRITERS:
                self._writers.clear()
            key = hashlib.blake2b(writer, key=self._writer_keys, digest_size=32).digest()
            cipher = self._writers[writer] = self._cipher(key)
        return cipher

    @staticmethod
    def _tag(
        cipher: Any,
        nonce: bytes,
        fixed: bytes | memoryview,
        encoded_key: bytes,
        payload: memoryview,
    ) -> bytes:
        # The fixed fields have a fixed size and the key's length precedes it: the plaintext
        # splits into (fixed, key) one way only. GCM's tag covers associated data and
        # ciphertext, so it binds the payload, the header and the block key.
        bound = bytes(fixed) + len(encoded_key).to_bytes(4, "little") + encoded_key
        sealed: bytes = cipher.encrypt(nonce + bytes(12 - _COUNTER_BYTES), bound, payload)
        return sealed[-_TAG_BYTES:]


def value_format(
    namespace: Namespace, secret: bytes | bytearray | str | None = None
) -> ValueFormat:
    """The format a store of ``namespace`` uses: sealed with ``secret``, plain without."""
    raw = secret_bytes(secret)
    return PlainFormat(namespace) if raw is None else SealedFormat(namespace, raw)
