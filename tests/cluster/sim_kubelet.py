"""A kubelet's certificate signing request, as the tests make one (``csr_pem``).

The simulated kubelet that used to join the fake API server from its user data is gone (issue
33): real kubelets join the real control plane from the rendered user data
(tests/realk8s/machine.py, tests/realk8s/test_join.py).
"""

from __future__ import annotations


def csr_pem(common_name: str, orgs: list[str], ips: list[str] = (), dns: list[str] = ()) -> bytes:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    subject.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    builder = x509.CertificateSigningRequestBuilder().subject_name(x509.Name(subject))
    sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
