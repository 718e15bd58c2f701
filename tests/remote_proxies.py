"""What the remote tests put between a store and a real server, all on 127.0.0.1, each a
thread of the test's own: a link that trickles, a TLS terminator, and the one fake server
(it speaks wrong protocol on purpose: no real server would).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Self

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


class _Listener:
    """Accepts connections on a port of its own, one thread per connection."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._listener.settimeout(0.05)  # accept() looks at _closed this often
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.accepted = 0  # connections accepted so far
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def url(self, scheme: str = "redis") -> str:
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._keep(client)
            self.accepted += 1
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _keep(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def _serve(self, client: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
        self._acceptor.join(5)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _Forwarder(_Listener):
    """Passes each connection on to the server at ``port``, both ways."""

    def __init__(self, port: int) -> None:
        self.target = port
        super().__init__()

    def _serve(self, client: socket.socket) -> None:
        try:
            client = self._wrap(client)
            server = socket.create_connection(("127.0.0.1", self.target))
        except OSError:
            client.close()
            return
        self._keep(server)
        threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
        self._pump(server, client, True)

    def _wrap(self, client: socket.socket) -> socket.socket:
        return client

    def _pump(self, source: socket.socket, sink: socket.socket, to_client: bool) -> None:
        with contextlib.suppress(OSError):
            while True:
                data = source.recv(self._piece(to_client))
                if not data:
                    break
                self._pass(sink, data, to_client)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _piece(self, to_client: bool) -> int:
        return 256 * 1024

    def _pass(self, sink: socket.socket, data: bytes, to_client: bool) -> None:
        sink.sendall(data)


class TrickleProxy(_Forwarder):
    """A link that passes ``piece`` bytes every ``every_s`` seconds, each way (2 KiB every
    0.3 s: a call that waits per socket operation, not per call, is held for ever)."""

    def __init__(self, port: int, *, piece: int = 2048, every_s: float = 0.3) -> None:
        self.piece, self.every_s = piece, every_s
        super().__init__(port)

    def _piece(self, to_client: bool) -> int:
        return self.piece

    def _pass(self, sink: socket.socket, data: bytes, to_client: bool) -> None:
        time.sleep(self.every_s)
        sink.sendall(data)


class TlsProxy(_Forwarder):
    """Terminates TLS with ``certificate`` and passes the plain bytes on to the server."""

    def __init__(self, port: int, certificate: SelfSigned) -> None:
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(certificate.cert_file, certificate.key_file)
        super().__init__(port)

    def _wrap(self, client: socket.socket) -> socket.socket:
        client.settimeout(10)
        wrapped = self._context.wrap_socket(client, server_side=True)
        wrapped.settimeout(None)
        self._keep(wrapped)
        return wrapped


class FakeServer(_Listener):
    """Answers whatever it reads with ``reply(data)`` (bytes, sent as they are; ``None``
    closes the connection)."""

    def __init__(self, reply: Callable[[bytes], bytes | None]) -> None:
        self.reply = reply
        self.commands: list[bytes] = []
        super().__init__()

    def _serve(self, client: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                data = client.recv(1 << 20)
                if not data:
                    return
                self.commands.append(data)
                answer = self.reply(data)
                if answer is None:
                    client.shutdown(socket.SHUT_RDWR)
                    return
                client.sendall(answer)


class SelfSigned:
    """A self-signed certificate for 127.0.0.1 and ``localhost``, in ``folder``."""

    def __init__(self, folder: Path) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvoffload test")])
        now = datetime.datetime.now(datetime.UTC)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        self.cert_file = folder / "cert.pem"
        self.key_file = folder / "key.pem"
        self.cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        self.key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
