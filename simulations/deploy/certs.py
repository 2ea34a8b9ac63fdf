"""TLS certificates and SuperNode authentication keys generated for one deployment run."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from .files import private_dir, write_private

# Certificates only need to outlive one run; a short validity limits what a leaked file allows.
_VALIDITY = dt.timedelta(days=2)


@dataclass(frozen=True)
class TlsFiles:
    """Paths of the run's CA certificate and the SuperLink's certificate and key."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class NodeKeys:
    """Paths of one SuperNode's EC P-384 key pair in OpenSSH format (what Flower reads)."""

    private_key: Path
    public_key: Path


def make_tls(out_dir: Path, hosts: list[str]) -> TlsFiles:
    """Create a CA and a SuperLink certificate valid for ``hosts`` (IP addresses or names).

    Parameters
    ----------
    out_dir : Path
        Folder that receives ``ca.pem``, ``server.pem`` and ``server.key``.
    hosts : list[str]
        Subject alternative names; IP literals become IP SANs, anything else a DNS SAN.
    """
    if not hosts:
        raise ValueError("make_tls: hosts is empty, expected at least one address or name")
    private_dir(out_dir)
    now = dt.datetime.now(dt.UTC)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedgc deploy CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA384())
    )

    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA384())
    )

    files = TlsFiles(out_dir / "ca.pem", out_dir / "server.pem", out_dir / "server.key")
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    write_private(
        files.server_key,
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    return files


def make_node_keys(out_dir: Path, name: str) -> NodeKeys:
    """Create one SuperNode's authentication key pair (EC P-384, OpenSSH encoding)."""
    private_dir(out_dir)
    key = ec.generate_private_key(ec.SECP384R1())
    keys = NodeKeys(out_dir / f"{name}_key", out_dir / f"{name}_key.pub")
    write_private(
        keys.private_key,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        ),
    )
    keys.public_key.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
    )
    return keys
