"""Certificates for the mutual-TLS tests, made with the real ``openssl`` as an admin would.

:func:`warmserve_pki` runs ``hack/k8s/mkcerts.sh --warmserve`` (the certificates the docs tell
admins to make: agents serverAuth only, the operator clientAuth only with CN and SPIFFE URI).
:class:`Pki` mints the odd ones the tests need beside them from the same CA: a certificate with
both usages (what Helm's genSignedCert makes), one with another identity, one with no usage.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from warmserve.testing.k8s import REPO_ROOT

MKCERTS = REPO_ROOT / "hack" / "k8s" / "mkcerts.sh"


@dataclass(frozen=True)
class Cert:
    crt: Path
    key: Path
    ca: Path  # the CA that signed it


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


class Pki:
    """A CA in ``d`` (``ca.crt``, ``ca.key``) and leaves it signs."""

    def __init__(self, d: Path, name: str = "warmserve-test-ca", *, create: bool = True) -> None:
        self.dir = d
        self.ca = d / "ca.crt"
        self.ca_key = d / "ca.key"
        if create:
            d.mkdir(parents=True, exist_ok=True)
            _openssl(
                "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                "-nodes", "-keyout", str(self.ca_key), "-out", str(self.ca), "-days", "1",
                "-subj", f"/CN={name}",
            )  # fmt: skip

    def leaf(
        self,
        name: str,
        cn: str,
        *,
        eku: str | None = "clientAuth",
        dns: tuple[str, ...] = (),
        uris: tuple[str, ...] = (),
    ) -> Cert:
        """A P-256 certificate ``<name>.crt``/``.key`` with common name ``cn``; ``eku`` is the
        extendedKeyUsage value (e.g. ``serverAuth,clientAuth``; None: no such extension)."""
        key, csr, crt, ext = (self.dir / f"{name}.{s}" for s in ("key", "csr", "crt", "ext"))
        _openssl(
            "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={cn}",
        )  # fmt: skip
        lines = ["basicConstraints=critical,CA:FALSE"]
        if eku:
            lines.append(f"extendedKeyUsage={eku}")
        sans = [f"DNS:{d}" for d in dns] + [f"URI:{u}" for u in uris]
        if sans:
            lines.append("subjectAltName=" + ",".join(sans))
        ext.write_text("\n".join(lines) + "\n")
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(self.ca), "-CAkey", str(self.ca_key),
            "-CAcreateserial", "-out", str(crt), "-days", "1", "-extfile", str(ext),
        )  # fmt: skip
        return Cert(crt, key, self.ca)


@dataclass(frozen=True)
class WarmservePki:
    """What ``mkcerts.sh --warmserve`` made, plus its CA for minting more."""

    pki: Pki
    agent: Cert  # serverAuth only, DNS warmserve-agent
    operator: Cert  # clientAuth only, CN warmserve-operator + SPIFFE URI
    admin: Cert  # clientAuth only, CN warmserve-admin
    spiffe: str  # the operator's URI SAN


def warmserve_pki(d: Path, namespace: str = "warmserve") -> WarmservePki:
    subprocess.run(
        ["bash", str(MKCERTS), "--warmserve", str(d), namespace],
        check=True,
        capture_output=True,
        timeout=120,
    )

    def cert(folder: str) -> Cert:
        return Cert(d / folder / "tls.crt", d / folder / "tls.key", d / folder / "ca.crt")

    return WarmservePki(
        Pki(d, create=False),
        cert("agent-server"),
        cert("operator-client"),
        cert("admin-client"),
        f"spiffe://cluster.local/ns/{namespace}/sa/warmserve-operator",
    )
