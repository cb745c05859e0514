"""TLS for every gRPC server and channel of a process, and for the gateway's HTTP.

The shared token alone travels in clear text between hosts; a role started with ``--tls-cert --tls-key`` serves
TLS on all its ports and, with ``--tls-ca`` (default: the certificate itself, right for one self-signed cluster
certificate), opens its channels to the other roles over TLS, verifying their certificates.

Why one setting per process and not a parameter of every server and channel: a process is one identity on the
network, and its servers (Conductor, instance + Messenger, gateway) and channels (Conductor link, router,
Messenger clients) are built in many modules; each of them asks here (``add_port``, ``channel``) so none can be
left in clear text by a forgotten argument. ``configure`` is called once at start by the role commands; a
process that never calls it (tests, ``mj.Cluster``) speaks plaintext as before.
"""

from __future__ import annotations

import dataclasses
import ssl
import threading
from pathlib import Path

import grpc


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """PEM files: this process's certificate chain and key, and the CA bundle its peers' certificates chain to."""

    cert: Path
    key: Path
    ca: Path

    def read(self) -> tuple[bytes, bytes, bytes]:
        return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()


_lock = threading.Lock()
_files: TlsFiles | None = None


def configure(cert: str | Path | None, key: str | Path | None, ca: str | Path | None = None) -> TlsFiles | None:
    """Turn TLS on for this process (both of ``cert`` and ``key``, or neither: plaintext). ValueError naming the
    file that is missing, unreadable or not a certificate/key pair, before any server starts."""
    global _files
    if cert is None and key is None:
        if ca is not None:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key")
        return None
    if cert is None or key is None:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    files = TlsFiles(Path(cert), Path(key), Path(ca if ca is not None else cert))
    for name, path in (("--tls-cert", files.cert), ("--tls-key", files.key), ("--tls-ca", files.ca)):
        if not path.is_file():
            raise ValueError(f"{name} {path}: no such file")
    try:
        ssl.create_default_context().load_cert_chain(files.cert, files.key)
        ssl.create_default_context(cafile=str(files.ca))
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"TLS files {files.cert} / {files.key} / {files.ca} are not a usable PEM certificate, key "
                         f"and CA: {e}") from None
    with _lock:
        _files = files
    return files


def reset() -> None:
    """Back to plaintext (tests)."""
    global _files
    with _lock:
        _files = None


def files() -> TlsFiles | None:
    return _files


def add_port(server: grpc.Server, address: str) -> int:
    """Bind ``server`` to ``address`` (TLS when configured); the port bound, 0 when it could not bind."""
    tls = _files
    if tls is None:
        return server.add_insecure_port(address)
    cert, key, _ = tls.read()
    return server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))


def channel(address: str, options) -> grpc.Channel:
    """A channel to ``address``: TLS (verifying the peer against the CA) when configured, else plaintext."""
    tls = _files
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    cert, key, ca = tls.read()
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.secure_channel(address, credentials, options=options)


def http_ssl_files() -> dict:
    """uvicorn's TLS options for the gateway's HTTP server ({} without TLS)."""
    tls = _files
    return {} if tls is None else {"ssl_certfile": str(tls.cert), "ssl_keyfile": str(tls.key)}
