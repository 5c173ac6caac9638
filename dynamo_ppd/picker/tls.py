"""TLS for the picker's ext_proc port, as GAIE's endpoint picker serves it.

GAIE's EPP serves ext_proc over TLS by default (``--secure-serving``): with a certificate from
``--cert-path`` (``tls.crt``/``tls.key``) or, without one, a self-signed certificate it makes at
start; the gateways' stock settings for an endpoint picker connect with TLS and do not verify it.
The picker does the same, so it drops into those settings unchanged. gRPC health on the separate
health port stays plaintext: the kubelet's gRPC probes speak no TLS.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import grpc


def self_signed(common_name: str = "dynamo-ppd-picker", days: int = 3650) -> tuple[bytes, bytes]:
    """A fresh EC P-256 key and a self-signed certificate for it: (key PEM, certificate PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(common_name)]), critical=False)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def read_cert_dir(path: str) -> tuple[bytes, bytes]:
    """``tls.key`` and ``tls.crt`` of a directory (a mounted kubernetes.io/tls Secret)."""
    directory = Path(path)
    files = [directory / "tls.key", directory / "tls.crt"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"--cert-path {path}: missing {', '.join(missing)} "
                                "(a kubernetes.io/tls Secret mounted there has both)")
    return files[0].read_bytes(), files[1].read_bytes()


def server_credentials(cert_path: str | None) -> tuple[grpc.ServerCredentials, bytes]:
    """Credentials for the ext_proc port and the certificate they present (PEM)."""
    key_pem, cert_pem = read_cert_dir(cert_path) if cert_path else self_signed()
    return grpc.ssl_server_credentials([(key_pem, cert_pem)]), cert_pem
