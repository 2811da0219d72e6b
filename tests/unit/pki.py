"""A throwaway PKI for TLS tests: a CA and one certificate it signed for 127.0.0.1, as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kv_transfer.security import KVTLSConfig


def write_pki(d: Path) -> tuple[KVTLSConfig, KVTLSConfig]:
    """A CA and one certificate it signed for 127.0.0.1 (server and client alike), as PEM files.
    Returns (server config: mutual TLS, client config)."""
    now = datetime.datetime.now(datetime.UTC)

    def cert(name: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey,
             ca: bool) -> x509.Certificate:  # fmt: skip
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tandem test CA")])
    files = {
        "ca.pem": cert("tandem test CA", ca_key, ca_name, ca_key, True).public_bytes(serialization.Encoding.PEM),
        "cert.pem": cert("127.0.0.1", key, ca_name, ca_key, False).public_bytes(serialization.Encoding.PEM),
        "key.pem": key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    }
    for name, data in files.items():
        (d / name).write_bytes(data)
    cert_file, key_file, ca_file = (str(d / n) for n in ("cert.pem", "key.pem", "ca.pem"))
    return KVTLSConfig(cert_file, key_file, ca_file), KVTLSConfig(cert_file, key_file, ca_file)
