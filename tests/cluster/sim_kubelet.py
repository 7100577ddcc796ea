"""A kubelet's certificate signing request, as the tests make one (``csr_pem``).

The simulated kubelet that used to join the fake API server from its user data is gone (issue
33): real kubelets join the real control plane from the rendered user data
(tests/realk8s/machine.py, tests/realk8s/test_join.py).
"""

from __future__ import annotations

import base64


def csr_pem(common_name: str, orgs: list[str], ips: list[str] = (), dns: list[str] = ()) -> bytes:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    # Unvalidated: RFC 5280 bounds a common name to 64 characters, which cryptography enforces when it
    # builds one but not when it reads one, and Go's parser (the API server's) not at all; a node may.
    subject.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name, _validate=False))
    builder = x509.CertificateSigningRequestBuilder().subject_name(x509.Name(subject))
    sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def unreadable_csr_pem(common_name: str, orgs: list[str], flaw: str) -> bytes:
    """A kubelet's request with the right subject and a valid signature whose extensions
    cryptography cannot read, while Go's ``x509.ParseCertificateRequest`` (the API server's, which
    reads only the SAN extension) accepts it: ``flaw`` is ``"key-usage"`` (a KeyUsage that is a NULL,
    not a BIT STRING) or ``"duplicate"`` (a well-formed KeyUsage twice)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtensionOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    # Unvalidated: RFC 5280 bounds a common name to 64 characters, which cryptography enforces when it
    # builds one but not when it reads one, and Go's parser (the API server's) not at all; a node may.
    subject.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name, _validate=False))
    builder = x509.CertificateSigningRequestBuilder().subject_name(x509.Name(subject))
    if flaw == "key-usage":
        builder = builder.add_extension(x509.UnrecognizedExtension(ExtensionOID.KEY_USAGE, b"\x05\x00"), critical=False)
        return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
    assert flaw == "duplicate", flaw
    # The builder refuses a second KeyUsage: it is written as an ExtendedKeyUsage, whose OID
    # (2.5.29.37) is then made KeyUsage's (2.5.29.15, as long), and the request signed again.
    digital_signature = b"\x03\x02\x07\x80"
    for oid in (ExtensionOID.KEY_USAGE, ExtensionOID.EXTENDED_KEY_USAGE):
        builder = builder.add_extension(x509.UnrecognizedExtension(oid, digital_signature), critical=False)
    written = builder.sign(key, hashes.SHA256())
    extended, key_usage = bytes.fromhex("0603551d25"), bytes.fromhex("0603551d0f")
    assert written.tbs_certrequest_bytes.count(extended) == 1
    tbs = written.tbs_certrequest_bytes.replace(extended, key_usage)
    ecdsa_with_sha256 = _der(0x30, _der(0x06, bytes.fromhex("2a8648ce3d040302")))
    signature = _der(0x03, b"\x00" + key.sign(tbs, ec.ECDSA(hashes.SHA256())))
    der = _der(0x30, tbs + ecdsa_with_sha256 + signature)
    return b"-----BEGIN CERTIFICATE REQUEST-----\n" + base64.encodebytes(der) + b"-----END CERTIFICATE REQUEST-----\n"


def _der(tag: int, content: bytes) -> bytes:
    """One DER element: its tag, its length, ``content``."""
    size = len(content)
    if size < 0x80:
        return bytes([tag, size]) + content
    length = size.to_bytes((size.bit_length() + 7) // 8, "big")
    return bytes([tag, 0x80 | len(length)]) + length + content
