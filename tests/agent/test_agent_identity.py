"""Who may drive an agent over mutual TLS (agent/warmserve_agent/auth.py): real gRPC, real
certificates from hack/k8s/mkcerts.sh --warmserve, and second certificates from the same CA.

A chain to the CA is not enough: an agent's own server certificate, a certificate with both
usages but an agent's name (what Helm's genSignedCert makes), and one with another name are
refused; the operator's is accepted, an admin's reader certificate may only read.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from warmserve_agent.config import ConfigError
from warmserve_agent.testing import AgentThread

from tests.agent.agent_support import cfg_for
from tests.tls_support import Cert, WarmservePki, warmserve_pki
from warmserve.api.agent.client import AgentClient, AgentError, SyncAgentClient

SERVER_NAME = "warmserve-agent"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> WarmservePki:
    return warmserve_pki(tmp_path_factory.mktemp("pki") / "mtls", namespace="ws")


def _agent(tmp_path: Path, model_root: Path, pki: WarmservePki, **kw: Any) -> AgentThread:
    return AgentThread(
        cfg_for(
            tmp_path,
            model_root,
            tls_cert=pki.agent.crt,
            tls_key=pki.agent.key,
            client_ca=pki.agent.ca,
            **kw,
        )
    )


def _client(address: str, cert: Cert, ca: Path, **kw: Any) -> SyncAgentClient:
    return SyncAgentClient(
        address,
        ca_cert=ca,
        client_cert=cert.crt,
        client_key=cert.key,
        server_name=SERVER_NAME,
        timeout_s=5,
        **kw,
    )


def _code(fn: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(AgentError) as info:
        fn()
    return info.value.code, info.value.message


def test_the_operator_is_accepted_and_second_certificates_from_the_ca_are_refused(
    tmp_path: Path, model_root: Path, pki: WarmservePki
) -> None:
    impostor = pki.pki.leaf("impostor", "mallory", eku="clientAuth")
    # Helm's genSignedCert: serverAuth *and* clientAuth, the agents' name.
    dual = pki.pki.leaf("dual", SERVER_NAME, eku="serverAuth,clientAuth", dns=(SERVER_NAME,))
    no_eku = pki.pki.leaf("plain", "someone", eku=None)
    with _agent(tmp_path, model_root, pki) as a:  # the default allowlist: the operator
        with _client(a.address, pki.operator, pki.operator.ca) as op:
            assert op.describe().node_name == "node-a"
            op.prewarm_wait("alpha", [0], 0, request_id="p1")
        # An agent's key used to call another agent: its certificate has no clientAuth usage,
        # so the TLS handshake itself fails (BoringSSL: unsupported certificate purpose).
        with _client(a.address, pki.agent, pki.agent.ca) as agent_key:
            code, _ = _code(agent_key.describe)
            assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        for cert, shown in (
            (impostor, "CN=mallory"),
            (dual, f"CN={SERVER_NAME}"),
            (no_eku, "CN=someone"),
        ):
            with _client(a.address, cert, pki.pki.ca) as other:
                for call in (
                    other.describe,
                    lambda o=other: o.prewarm_wait("beta", [1], 0, request_id="p2"),
                ):
                    code, msg = _code(call)
                    assert code == grpc.StatusCode.PERMISSION_DENIED, (shown, code, msg)
                    assert f"client certificate {shown}" in msg and "not allowed" in msg, msg
                    assert "CN=warmserve-operator" in msg  # what it accepts
                assert other.health() == "SERVING"  # probes stay open to any client
        with _client(a.address, pki.operator, pki.operator.ca) as op:
            assert [s.model for s in op.describe().slots] == ["alpha"]  # nothing else ran


def test_a_reader_may_describe_and_watch_but_not_change_or_fence(
    tmp_path: Path, model_root: Path, pki: WarmservePki
) -> None:
    readers = ("CN=warmserve-admin",)
    with _agent(tmp_path, model_root, pki, reader_ids=readers) as a:
        with _client(a.address, pki.admin, pki.admin.ca) as admin:
            assert admin.describe().node_name == "node-a"
            code, msg = _code(lambda: admin.prewarm_wait("alpha", [0], 0, request_id="p1"))
            assert code == grpc.StatusCode.PERMISSION_DENIED
            assert "CN=warmserve-admin (URI SANs: none) may only read" in msg and "Prewarm" in msg

        async def reads() -> None:
            kw = dict(client_cert=pki.admin.crt, client_key=pki.admin.key)
            async with AgentClient(
                a.address, ca_cert=pki.admin.ca, server_name=SERVER_NAME, **kw
            ) as c:
                with pytest.raises(AgentError) as info:
                    await c.describe(fencing_token=7)
                assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
                assert "may not carry a fencing token" in info.value.message
                async for ev in c.watch(include_snapshot=True):
                    assert ev.kind  # the stream opens: a reader may watch
                    break

        a.run(reads())
        assert a.server.fence.highest == 0, "a reader's token never moved the fence"
        # The admin's CLI, as docs/security.md says to run it.
        tls = ["--ca-cert", str(pki.admin.ca), "--client-cert", str(pki.admin.crt)]
        tls += ["--client-key", str(pki.admin.key), "--server-name", SERVER_NAME]
        cli = [sys.executable, "-m", "warmserve", "agent", "inspect", a.address, "--json"]
        out = subprocess.run([*cli, *tls], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["node_name"] == "node-a"


def test_a_spiffe_allowlist_matches_the_uri_san_not_the_common_name(
    tmp_path: Path, model_root: Path, pki: WarmservePki
) -> None:
    # Same common name as the operator, no URI SAN: refused when the agent wants the SPIFFE ID.
    same_cn = pki.pki.leaf("same-cn", "warmserve-operator", eku="clientAuth")
    with _agent(tmp_path, model_root, pki, client_ids=(pki.spiffe,)) as a:
        with _client(a.address, pki.operator, pki.operator.ca) as op:
            assert op.describe().node_name == "node-a"
        with _client(a.address, same_cn, pki.pki.ca) as other:
            code, msg = _code(other.describe)
            assert code == grpc.StatusCode.PERMISSION_DENIED
            assert "CN=warmserve-operator (URI SANs: none) is not allowed" in msg
            assert pki.spiffe in msg  # what it accepts


def test_the_operator_refuses_a_client_certificate_serving_as_an_agent(
    tmp_path: Path, model_root: Path, pki: WarmservePki
) -> None:
    """The operator's own certificate (clientAuth only) cannot impersonate an agent."""
    from warmserve_operator.agents import AgentAuth, GrpcAgent
    from warmserve_operator.snapshot import AgentCallError

    op = pki.operator
    cfg = cfg_for(tmp_path, model_root, tls_cert=op.crt, tls_key=op.key, client_ca=op.ca)
    auth = AgentAuth(
        ca_cert=str(op.ca),
        client_cert=str(op.crt),
        client_key=str(op.key),
        server_name="warmserve-operator",
        timeout_s=5,
    )
    with AgentThread(cfg) as a:

        async def describe() -> None:
            agent = GrpcAgent("n1", a.address, auth)
            try:
                await agent.describe()
            finally:
                await agent.close()

        with pytest.raises(AgentCallError) as info:
            a.run(describe())
        assert info.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    with _agent(tmp_path, model_root, pki) as a:  # the operator's port over the right pair

        async def ok() -> str:
            agent = GrpcAgent("n1", a.address, replace(auth, server_name=SERVER_NAME))
            try:
                return (await agent.describe()).node
            finally:
                await agent.close()

        assert a.run(ok()) == "n1"


def test_identities_are_parsed_strictly_and_need_mutual_tls(
    tmp_path: Path, model_root: Path, pki: WarmservePki
) -> None:
    from warmserve_agent.auth import ClientIdentities, PeerIdentity, Role, parse_identity

    assert parse_identity(" CN=warmserve-operator ") == "CN=warmserve-operator"
    assert parse_identity("spiffe://td/ns/a/sa/b") == "spiffe://td/ns/a/sa/b"
    for bad in ("warmserve-operator", "CN=", "spiffe://", "cn=x", "spiffe://a b", "1x://y"):
        with pytest.raises(ValueError, match="give CN=<common name> or a URI SAN"):
            parse_identity(bad)
    ids = ClientIdentities.parse([], ["CN=admin"])
    assert ids.callers == {"CN=warmserve-operator"}  # the default: the operator's
    assert ids.role(PeerIdentity("warmserve-operator")) is Role.CALLER
    assert ids.role(PeerIdentity("admin", ("spiffe://x/y",))) is Role.READER
    assert ids.role(PeerIdentity("", ("spiffe://x/y",))) is None
    with pytest.raises(ConfigError, match="need mutual TLS"):
        AgentThread(cfg_for(tmp_path, model_root, client_ids=("CN=x",))).__enter__()
    with pytest.raises(ConfigError, match="give CN=<common name>"):
        _agent(tmp_path, model_root, pki, client_ids=("operator",)).__enter__()


def test_the_cli_flags_reach_the_config(tmp_path: Path, pki: WarmservePki) -> None:
    import argparse

    from warmserve_agent.cli import register
    from warmserve_agent.cli.run import _config

    from warmserve.cli import CliError

    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())
    base = ["agent", "--gpus", "auto", "--model-dir", str(tmp_path)]
    tls = ["--tls-cert", str(pki.agent.crt), "--tls-key", str(pki.agent.key)]
    tls += ["--client-ca", str(pki.agent.ca)]
    ids = ["--allow-client-id", pki.spiffe, "--allow-client-id", "CN=op2"]
    ids += ["--allow-reader-id", "CN=warmserve-admin"]
    cfg = _config(ap.parse_args([*base, *tls, *ids]))
    assert cfg.client_ids == (pki.spiffe, "CN=op2") and cfg.reader_ids == ("CN=warmserve-admin",)
    with pytest.raises(CliError, match="need mutual TLS"):
        _config(ap.parse_args([*base, "--allow-client-id", "CN=x"]))
    with pytest.raises(CliError, match="give CN=<common name>"):
        _config(ap.parse_args([*base, *tls, "--allow-reader-id", "admin"]))
