"""Throwaway PKI for TLS tests: a CA, a server certificate for 127.0.0.1, client certificates."""

from __future__ import annotations

import datetime
import ipaddress
import pathlib

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _cert(subject: str, key, issuer_name, issuer_key, *, ca: bool = False, san: x509.GeneralName | None = None):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName([san]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(folder: pathlib.Path, clients: list[str]) -> dict[str, pathlib.Path]:
    """Writes ca.pem, server.pem/server.key (127.0.0.1) and <name>.pem/<name>.key per client."""
    ca_key = _key()
    ca = _cert("hookwire test CA", ca_key, None, ca_key, ca=True)
    out = {"ca": folder / "ca.pem"}
    out["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    entries = [("server", x509.IPAddress(ipaddress.ip_address("127.0.0.1")))] + [(c, None) for c in clients]
    for name, san in entries:
        key = _key()
        cert = _cert(name if name != "server" else "127.0.0.1", key, ca.subject, ca_key, san=san)
        (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (folder / f"{name}.key").write_bytes(_pem_key(key))
        out[f"{name}_cert"] = folder / f"{name}.pem"
        out[f"{name}_key"] = folder / f"{name}.key"
    return out
