"""Throwaway certificate authorities and certificates for the TLS tests (made with `cryptography`)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Issued:
    cert: Path
    key: Path


def _name(common_name: str, organization: str = "") -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)] if common_name else []
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def _write(folder: Path, stem: str, cert: x509.Certificate, key) -> Issued:
    cert_path, key_path = folder / f"{stem}.pem", folder / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return Issued(cert_path, key_path)


class CertificateAuthority:
    def __init__(self, folder: Path, name: str):
        self.folder = folder
        self.name = name
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
            )  # digital signature, key cert sign, CRL sign
            .sign(self.key, hashes.SHA256())
        )
        self.bundle = folder / f"{name}-ca.pem"
        self.bundle.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        stem: str,
        common_name: str,
        server: bool,
        dns_names: tuple[str, ...] = ("localhost",),
        *,
        organization: str = "",
        uris: tuple[str, ...] = (),
    ) -> Issued:
        """A certificate this CA signed: a server's (its DNS names and 127.0.0.1 as SANs), or a client's (its
        ``uris`` and, if given other than the default, ``dns_names`` as SANs; ``common_name`` may be empty)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name, organization))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
        )
        if server:
            names = [*map(x509.DNSName, dns_names), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        else:
            names = [*map(x509.UniformResourceIdentifier, uris)]
            names += [x509.DNSName(name) for name in dns_names if dns_names != ("localhost",)]
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=not common_name)
        return _write(self.folder, stem, builder.sign(self.key, hashes.SHA256()), key)
