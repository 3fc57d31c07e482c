"""TLS and mutual TLS for Astrolabe's gRPC servers (the extproc, the predictor sidecar) and their clients, and
HTTPS to the backends (the extproc's health checks and metrics scrapes, the sidecar's /metrics scrape).

Certificates are PEM files, as Kubernetes Secrets of type ``kubernetes.io/tls`` (cert-manager's) mount them:
``tls.crt`` (the certificate chain, leaf first), ``tls.key`` (its private key) and ``ca.crt`` (the CA that
verifies the peer). A server given a client CA requires and verifies a client certificate (mTLS); a client given
its own certificate and key presents them.

Rotation: a server re-reads its files when one of them changed (modification time or size), at the next TLS
handshake (``grpc.dynamic_ssl_server_credentials``), so a renewed Secret takes effect on new connections without
a restart; connections already open keep the certificate they were set up with. A client's credentials are read
once per channel (grpc's Python API has no dynamic channel credentials): a sidecar channel is rebuilt only when
the endpoint leaves and returns.

Errors: `TlsError` (a ``ValueError``) names the file that is missing, unreadable or not PEM, and the role it has.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import ssl
from pathlib import Path

import grpc

logger = logging.getLogger(__name__)


class TlsError(ValueError):
    """A TLS file cannot be used: missing, unreadable, not PEM, or a certificate without its key."""


@dataclasses.dataclass(frozen=True, slots=True)
class ServerTls:
    """A gRPC server's TLS identity.

    Attributes:
        cert_file: PEM certificate chain presented to clients (leaf first).
        key_file: PEM private key of the leaf certificate.
        client_ca_file: PEM CA bundle that verifies client certificates; set = mutual TLS (a client without a
            certificate this CA signed fails the handshake); None = any client (server-only TLS).
    """

    cert_file: str
    key_file: str
    client_ca_file: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ClientTls:
    """How a gRPC client verifies its server, and the identity it presents.

    Attributes:
        ca_file: PEM CA bundle that verifies the server's certificate; None = the system's roots (gRPC's bundle).
        cert_file: PEM certificate chain presented to the server (mutual TLS); None = none. Set with key_file.
        key_file: PEM private key of cert_file.
        server_name: the name checked against the server's certificate (and sent as SNI) instead of the target's
            host, e.g. when connecting to a pod IP whose certificate names its Service; None = the target's host.
    """

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise TlsError("a client certificate needs its key and a key its certificate (cert_file and key_file "
                           "must be set together)")


def read_pem(path: str, role: str) -> bytes:
    """The bytes of a PEM file.

    Args:
        path: the file.
        role: what it is for, for the error ("server certificate", ...).

    Raises:
        TlsError: the file cannot be read or holds no PEM block.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsError(f"{role} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise TlsError(f"{role} {path}: not a PEM file (no '-----BEGIN' line)")
    return data


def check_pair(cert_file: str, key_file: str, role: str) -> None:
    """Checks that ``key_file`` is the private key of the leaf of ``cert_file`` (gRPC would only fail to bind, or
    fail each handshake, without saying why).

    Raises:
        TlsError: the pair does not load together (mismatched key, a CSR or other non-certificate, a wrong order).
    """
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        raise TlsError(f"{role} {cert_file} and its key {key_file} do not load together ({exc.reason or exc}): "
                       "is the key the certificate's, and the certificate first?") from None
    except OSError as exc:
        raise TlsError(f"{role} {cert_file} / {key_file}: {exc.strerror or exc}") from None


def _stamp(paths: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    stamps = []
    for path in paths:
        try:
            stat = os.stat(path)
        except OSError:
            stamps.append((-1, -1))
        else:
            stamps.append((stat.st_mtime_ns, stat.st_size))
    return tuple(stamps)


class _RotatingServerCertificate:
    """The certificate configuration of a server, re-read when its files change (the fetcher of
    ``grpc.dynamic_ssl_server_credentials``, called by gRPC at each handshake)."""

    def __init__(self, tls: ServerTls) -> None:
        self.tls = tls
        self._paths = tuple(p for p in (tls.cert_file, tls.key_file, tls.client_ca_file) if p)
        self._stamp = _stamp(self._paths)
        self.initial = self._load()

    def _load(self) -> grpc.ServerCertificateConfiguration:
        tls = self.tls
        key = read_pem(tls.key_file, "server private key")
        chain = read_pem(tls.cert_file, "server certificate")
        check_pair(tls.cert_file, tls.key_file, "server certificate")
        client_ca = read_pem(tls.client_ca_file, "client CA") if tls.client_ca_file else None
        return grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=client_ca)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        """The new configuration when a file changed since the last load, else None (keep the current one)."""
        stamp = _stamp(self._paths)
        if stamp == self._stamp:
            return None
        try:
            config = self._load()
        except TlsError as exc:  # e.g. caught between the key's and the certificate's write: retried next handshake
            logger.warning("TLS files changed but cannot be loaded (keeping the previous ones): %s", exc)
            return None
        self._stamp = stamp
        logger.info("TLS certificate reloaded from %s", self.tls.cert_file)
        return config


def server_credentials(tls: ServerTls) -> grpc.ServerCredentials:
    """Credentials for ``server.add_secure_port``: TLS with ``tls``'s certificate, mutual when it names a client CA,
    reloaded when the files change (module docstring).

    Raises:
        TlsError: a file cannot be used.
    """
    certificate = _RotatingServerCertificate(tls)
    return grpc.dynamic_ssl_server_credentials(certificate.initial, certificate,
                                               require_client_authentication=tls.client_ca_file is not None)


def channel_credentials(tls: ClientTls) -> grpc.ChannelCredentials:
    """Credentials for ``grpc.aio.secure_channel``: verify the server with ``tls.ca_file`` (or the system roots),
    present ``tls.cert_file`` when set.

    Raises:
        TlsError: a file cannot be used.
    """
    if tls.cert_file and tls.key_file:
        read_pem(tls.cert_file, "client certificate")
        read_pem(tls.key_file, "client private key")
        check_pair(tls.cert_file, tls.key_file, "client certificate")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(tls.ca_file, "CA") if tls.ca_file else None,
        private_key=read_pem(tls.key_file, "client private key") if tls.key_file else None,
        certificate_chain=read_pem(tls.cert_file, "client certificate") if tls.cert_file else None)


def channel_options(tls: ClientTls | None) -> list[tuple[str, str]]:
    """Channel options that ``tls`` implies: the name to verify when it overrides the target's host."""
    if tls is not None and tls.server_name:
        return [("grpc.ssl_target_name_override", tls.server_name)]
    return []


def add_port(server: grpc.aio.Server, address: str, tls: ServerTls | None) -> int:
    """Binds ``address`` on ``server``, with TLS when ``tls`` is set; returns the port (0 = it could not bind).

    Raises:
        TlsError: a file of ``tls`` cannot be used.
    """
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(tls))


@dataclasses.dataclass(frozen=True, slots=True)
class BackendTls:
    """HTTPS to a backend (a vLLM server started with ``--ssl-certfile``), as Envoy's ``--backend-tls-ca``.

    Attributes:
        ca_file: PEM CA bundle that verifies the backend's certificate.
        server_name: the DNS name its certificate must carry (and the SNI sent); None = the CA's signature alone
            is checked (a pod is dialled by IP; its certificate usually names a Service), as Envoy does without
            ``--backend-tls-server-name``.
    """

    ca_file: str
    server_name: str | None = None


def https_context(tls: BackendTls) -> ssl.SSLContext:
    """An ``ssl.SSLContext`` for aiohttp requests to a backend: verifies the chain against ``tls.ca_file``, and
    the host name only when ``tls.server_name`` is set (pass it as aiohttp's ``server_hostname``).

    Raises:
        TlsError: the CA file cannot be read or is not PEM.
    """
    read_pem(tls.ca_file, "backend CA")
    try:
        context = ssl.create_default_context(cafile=tls.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsError(f"backend CA {tls.ca_file}: {exc}") from None
    context.check_hostname = tls.server_name is not None
    return context


def backend_url(address: str, path: str, tls: BackendTls | None) -> str:
    """``http(s)://address/path``: https when ``tls`` is set. ``address`` is ``host:port``; ``path`` starts with /."""
    return f"{'https' if tls is not None else 'http'}://{address}{path}"


def https_request_options(tls: BackendTls | None) -> dict[str, object]:
    """Keyword arguments of an aiohttp request to a backend: none for plaintext, else ``ssl`` (`https_context`,
    built once here: call this once and reuse the result) and ``server_hostname``.

    Raises:
        TlsError: the CA file cannot be used.
    """
    if tls is None:
        return {}
    return {"ssl": https_context(tls), "server_hostname": tls.server_name}
