"""`reconfig certs --hosts h1,h2 --out DIR`: a development CA and one certificate and key per host, for the stack's
mutual TLS (services.rpc.tls). Each certificate serves both ends of a link (server and client authentication) and
names its host, plus localhost and the loopback addresses (the services of one host dial each other there)."""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
CA_CERT, CA_KEY = "ca.pem", "ca-key.pem"
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.\-:]*[A-Za-z0-9])?$")  # a DNS name or an IPv4/IPv6 address


@dataclass(frozen=True, slots=True)
class HostFiles:
    """One host's certificate and key (PEM), beside the CA's certificate: its --tls-cert, --tls-key, --tls-ca."""

    host: str
    cert: Path
    key: Path
    ca: Path


def check_hosts(hosts: list[str]) -> list[str]:
    """The host names, stripped and without duplicates; ValueError naming one that cannot be a certificate's."""
    checked: list[str] = []
    for host in (h.strip() for h in hosts):
        if not host:
            continue
        if not _HOST.match(host) or ".." in host:
            raise ValueError(f"{host!r} is not a host name or an IP address")
        if host not in checked:
            checked.append(host)
    if not checked:
        raise ValueError("--hosts names no host")
    return checked


def _subject_names(host: str):
    from cryptography import x509

    names = []
    for name in (host, *LOCAL_NAMES):
        try:
            entry = x509.IPAddress(ipaddress.ip_address(name))
        except ValueError:
            entry = x509.DNSName(name)
        if entry not in names:
            names.append(entry)
    return names


def _write_private(path: Path, data: bytes) -> None:
    """Write a key with mode 0600 from its creation (never readable by others, even briefly)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)


def write_dev_certs(hosts: list[str], out: Path | str, days: int = 365) -> list[HostFiles]:
    """A new CA in `out` (ca.pem, ca-key.pem) and, for each host, HOST.pem and HOST-key.pem signed by it (keys
    0600); the files of each host. ECDSA P-256 keys, SHA-256 signatures."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    hosts = check_hosts(hosts)
    if days < 1:
        raise ValueError(f"days must be >= 1, not {days}")
    out = Path(out)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    not_before, not_after = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def pem_key(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "reconfig development CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(not_before).not_valid_after(not_after)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                            crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))
    ca_path = out / CA_CERT
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(out / CA_KEY, pem_key(ca_key))

    written = []
    for host in hosts:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(not_before).not_valid_after(not_after)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(_subject_names(host)), critical=False)
                # both ends of a link: a worker serves the router and dials the weight store with the same files
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        files = HostFiles(host, out / f"{host}.pem", out / f"{host}-key.pem", ca_path)
        files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_private(files.key, pem_key(key))
        written.append(files)
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hosts", required=True, metavar="H1,H2,...",
                        help="the hosts (names or addresses) a certificate is made for; each also names localhost "
                             "and 127.0.0.1")
    parser.add_argument("--out", required=True, type=Path, help="directory to write ca.pem and HOST.pem/-key.pem to")
    parser.add_argument("--days", type=int, default=365, help="validity of the CA and the certificates [365]")


def run(args: argparse.Namespace) -> int:
    """`reconfig certs`: write the files and say how to use them."""
    written = write_dev_certs(args.hosts.split(","), args.out, args.days)
    print(f"wrote a development CA to {args.out / CA_CERT} (its key {args.out / CA_KEY}, mode 0600: keep it off the "
          "hosts)")
    for files in written:
        print(f"  {files.host}: --tls-cert {files.cert} --tls-key {files.key} --tls-ca {files.ca}")
    return 0
