"""The chart's least privilege: split agent/operator certificates with an identity allowlist
(tried over real gRPC with the rendered secrets), NetworkPolicies that select the right pods
and ports (rendered by the real helm, validated and stored by the real kube-apiserver), no
ServiceAccount token in agent pods, and tenant RBAC aggregated into `edit`/`view` (tried with a
tenant's token against the real kube-apiserver and its aggregation controller).

NetworkPolicies are not enforced here (no network plugin): the tests check what they select.
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml
from test_chart import CHART, _find, _helm, _parse_cli, _render

from warmserve.testing.k8s import REPO_ROOT, ControlPlane

FULL = "ws-warmserve"  # the fullname of release "ws"
COMPONENTS = {"agent": ("DaemonSet", "-agent"), "operator": ("Deployment", "-operator")}
COMPONENTS["gateway"] = ("Deployment", "-gateway")


def _container(docs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    return _find(docs, kind, suffix)["spec"]["template"]["spec"]["containers"][0]


def _secret_files(docs: list[dict[str, Any]], suffix: str, d: Path) -> dict[str, Path]:
    d.mkdir(parents=True)
    out = {}
    for key, value in _find(docs, "Secret", suffix)["data"].items():
        out[key] = d / key
        out[key].write_bytes(base64.b64decode(value))
    return out


def _verifies(ca: Path, cert: Path) -> bool:
    proc = subprocess.run(
        ["openssl", "verify", "-CAfile", str(ca), str(cert)], capture_output=True, timeout=60
    )
    return proc.returncode == 0


# ---- certificates and identities -----------------------------------------------------------


def test_generated_certificates_are_split_and_only_the_operator_drives_an_agent(
    k8s_bin_dir: Path, tmp_path: Path
) -> None:
    """Mode generate: Helm cannot choose usages (genSignedCert gives both), so each side has
    its own CA; an agent started as the chart starts it accepts the rendered operator
    certificate and refuses an agent's certificate and another install's operator."""
    from warmserve_agent.config import AgentConfig
    from warmserve_agent.testing import AgentThread

    from warmserve.api.agent.client import AgentError, SyncAgentClient

    docs = _render(k8s_bin_dir)
    server = _secret_files(docs, "-agent-server-tls", tmp_path / "server")
    client = _secret_files(docs, "-operator-client-tls", tmp_path / "client")
    tls = [d for d in docs if d["kind"] == "Secret" and d.get("type") == "kubernetes.io/tls"]
    assert len(tls) == 2, [d["metadata"]["name"] for d in tls]
    for doc in tls:
        assert doc["metadata"]["annotations"]["warmserve.io/pki"] == "split-ca-v1"
    assert server["ca.crt"].read_bytes() != client["ca.crt"].read_bytes()
    # Each secret's ca.crt is the other side's CA.
    assert _verifies(server["ca.crt"], client["tls.crt"])
    assert _verifies(client["ca.crt"], server["tls.crt"])
    assert not _verifies(server["ca.crt"], server["tls.crt"]), "agents would accept agents"
    other = _secret_files(_render(k8s_bin_dir), "-operator-client-tls", tmp_path / "other")

    agent = _container(docs, "DaemonSet", "-agent")
    ns = _parse_cli(agent["args"])
    assert ns.allow_client_id == [f"CN={FULL}-operator"] and ns.allow_reader_id == []
    op = _parse_cli(_container(docs, "Deployment", "-operator")["args"])
    (tmp_path / "models").mkdir()
    cfg = AgentConfig(
        model_dir=tmp_path / "models",
        simulate_gpus=[4 * 1024**2],
        listen="127.0.0.1:0",
        page_bytes=64 * 1024,
        memory_dir=tmp_path / "gpus",
        node_name="node-a",
        use_workers=False,
        tls_cert=server["tls.crt"],
        tls_key=server["tls.key"],
        client_ca=server["ca.crt"],
        client_ids=tuple(ns.allow_client_id),
    )

    def call(files: dict[str, Path], address: str) -> str:
        with SyncAgentClient(
            address,
            ca_cert=client["ca.crt"],  # the operator's trust: the agent CA
            client_cert=files["tls.crt"],
            client_key=files["tls.key"],
            server_name=op.agent_server_name,
            timeout_s=5,
        ) as c:
            try:
                return c.describe().node_name
            except AgentError as exc:
                return exc.code.name

    with AgentThread(cfg) as a:
        assert call(client, a.address) == "node-a"
        assert call(server, a.address) in ("UNAVAILABLE", "DEADLINE_EXCEEDED")  # not its CA
        assert call(other, a.address) in ("UNAVAILABLE", "DEADLINE_EXCEEDED")  # another CA


def test_identity_values_reach_the_agents_and_are_checked(k8s_bin_dir: Path) -> None:
    spiffe = "spiffe://cluster.local/ns/warmserve/sa/ws-warmserve-operator"
    docs = _render(
        k8s_bin_dir,
        "--set-json",
        f'tls.clientIdentities=["{spiffe}","CN=ops-break-glass"]',
        "--set-json",
        'tls.readerIdentities=["CN=warmserve-admin"]',
    )
    ns = _parse_cli(_container(docs, "DaemonSet", "-agent")["args"])
    assert ns.allow_client_id == [spiffe, "CN=ops-break-glass"]
    assert ns.allow_reader_id == ["CN=warmserve-admin"]
    bad = _helm(
        k8s_bin_dir, "template", "ws", str(CHART), "--set-json",
        'tls.clientIdentities=["ws-warmserve-operator"]', check=False,
    )  # fmt: skip
    assert bad.returncode != 0 and "at '/tls/clientIdentities/0'" in bad.stderr
    off = _render(k8s_bin_dir, "--set", "tls.enabled=false", "--set", "tls.allowInsecure=true")
    off_args = _container(off, "DaemonSet", "-agent")["args"]
    assert not [a for a in off_args if a.startswith(("--allow-client-id", "--allow-reader-id"))]


def test_existing_secrets_are_one_per_side(k8s_bin_dir: Path) -> None:
    one = _helm(
        k8s_bin_dir, "template", "ws", str(CHART), "--set", "tls.mode=existingSecret",
        "--set", "tls.existingSecret=shared", check=False,
    )  # fmt: skip
    assert one.returncode != 0
    assert "would let any agent's key drive every other agent" in one.stderr
    assert "hack/k8s/mkcerts.sh --warmserve" in one.stderr
    docs = _render(
        k8s_bin_dir, "--set", "tls.mode=existingSecret",
        "--set", "tls.serverSecret=agents-tls", "--set", "tls.clientSecret=operator-tls",
    )  # fmt: skip
    # The /demand token (templates/demand-token.yaml) is the only Secret the chart still makes.
    secrets = [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"]
    assert secrets == ["ws-warmserve-demand-token"], secrets
    for kind, suffix, secret in (
        ("DaemonSet", "-agent", "agents-tls"),
        ("Deployment", "-operator", "operator-tls"),
    ):
        volumes = _find(docs, kind, suffix)["spec"]["template"]["spec"]["volumes"]
        assert {"secretName": secret, "defaultMode": 0o440} in [v.get("secret") for v in volumes]


def test_cert_manager_certificates_have_split_usages(k8s_bin_dir: Path) -> None:
    docs = _render(
        k8s_bin_dir, "--set", "tls.mode=certManager", "--set", "tls.certManager.issuerRef.name=ca"
    )
    certs = {c["metadata"]["name"]: c["spec"] for c in docs if c["kind"] == "Certificate"}
    server, client = certs[f"{FULL}-agent-server"], certs[f"{FULL}-operator-client"]
    assert "server auth" in server["usages"] and "client auth" not in server["usages"]
    assert "client auth" in client["usages"] and "server auth" not in client["usages"]
    assert client["commonName"] == f"{FULL}-operator"
    ns = _parse_cli(_container(docs, "DaemonSet", "-agent")["args"])
    assert ns.allow_client_id == [f"CN={FULL}-operator"]


def test_agent_pods_get_no_api_token_and_engines_bind_the_pod_ip(k8s_bin_dir: Path) -> None:
    docs = _render(k8s_bin_dir)
    pod = _find(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    sa = _find(docs, "ServiceAccount", "-agent")
    assert sa["automountServiceAccountToken"] is False
    ns = _parse_cli(pod["containers"][0]["args"])
    assert (ns.engine_host, ns.advertise_host) == ("$(POD_IP)", "$(POD_IP)")
    # The agent's code never talks to the Kubernetes API: no client is imported anywhere in it.
    agent_src = REPO_ROOT / "agent" / "warmserve_agent"
    users = [
        p.relative_to(REPO_ROOT)
        for p in agent_src.rglob("*.py")
        if "import kubernetes" in p.read_text() or "from kubernetes" in p.read_text()
    ]
    assert users == []


# ---- NetworkPolicies ------------------------------------------------------------------------


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the chart uses matchLabels only
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _pod_labels(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {
        name: _find(docs, kind, suffix)["spec"]["template"]["metadata"]["labels"]
        for name, (kind, suffix) in COMPONENTS.items()
    }


def _policies(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each NetworkPolicy, by the one component whose pods it selects."""
    labels = _pod_labels(docs)
    out = {}
    for p in (d for d in docs if d["kind"] == "NetworkPolicy"):
        hit = [c for c, lab in labels.items() if _selects(p["spec"]["podSelector"], lab)]
        assert len(hit) == 1, (p["metadata"]["name"], hit)
        assert p["spec"]["policyTypes"] == ["Ingress"]
        out[hit[0]] = p["spec"]
    return out


def _allowed(spec: dict[str, Any], port: int) -> list[dict[str, Any]]:
    """The peers (``from`` entries; [{}] for anyone) that may reach ``port``."""
    peers: list[dict[str, Any]] = []
    for rule in spec.get("ingress") or []:
        for p in rule["ports"]:
            assert p["protocol"] == "TCP" and isinstance(p["port"], int)
            if p["port"] <= port <= p.get("endPort", p["port"]):
                peers += rule.get("from") or [{}]
    return peers


def _from_component(peers: list[dict[str, Any]], labels: dict[str, dict[str, str]]) -> set[str]:
    out = set()
    for peer in peers:
        if set(peer) == {"podSelector"}:  # pods of the release's namespace
            out |= {c for c, lab in labels.items() if _selects(peer["podSelector"], lab)}
        else:
            out.add(json.dumps(peer, sort_keys=True))
    return out


PROMETHEUS = json.dumps(
    {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    },
    sort_keys=True,
)


def test_network_policies_let_only_the_right_pods_reach_each_port(k8s_bin_dir: Path) -> None:
    docs = _render(k8s_bin_dir)
    labels = _pod_labels(docs)
    pol = _policies(docs)
    assert set(pol) == {"agent", "operator", "gateway"}
    ports = {
        c: {p["name"]: p["containerPort"] for p in _container(docs, *COMPONENTS[c])["ports"]}
        for c in COMPONENTS
    }

    def who(component: str, port: int) -> set[str]:
        return _from_component(_allowed(pol[component], port), labels)

    assert who("agent", ports["agent"]["grpc"]) == {"operator"}
    assert who("agent", ports["agent"]["metrics"]) == {PROMETHEUS}
    for engine_port in (32768, 40000, 50050, 50052, 9092 + 40000, 60999):
        assert who("agent", engine_port) == {"gateway"}, engine_port
    for outside in (22, 8000, 32767, 61000):
        assert who("agent", outside) == set(), outside
    assert who("operator", ports["operator"]["metrics"]) == {PROMETHEUS}
    assert who("operator", ports["operator"]["health"]) == set()  # the kubelet, from the node
    assert _allowed(pol["gateway"], ports["gateway"]["http"]) == [{}]  # clients: anyone
    assert who("gateway", ports["gateway"]["admin"]) == {"operator", PROMETHEUS}
    # The gateway's probes read the admin port (the API port's connection cap must not make a
    # busy replica unready): the kubelet probes from the node, which a policy always lets in;
    # the admin rule names that same port, so the operator's /demand reaches it too.
    gw = _container(docs, *COMPONENTS["gateway"])
    for probe in ("readinessProbe", "livenessProbe"):
        assert ports["gateway"][gw[probe]["httpGet"]["port"]] == ports["gateway"]["admin"], probe


def test_network_policy_values(k8s_bin_dir: Path) -> None:
    docs = _render(
        k8s_bin_dir,
        "--set", "agent.metricsPort=0",
        "--set", "agent.grpcPort=40000",
        "--set", "networkPolicy.enginePorts.from=40000",
        "--set", "networkPolicy.enginePorts.to=40010",
        "--set-json", 'networkPolicy.prometheus.namespaceSelector={"matchLabels":{"team":"obs"}}',
        "--set-json", 'networkPolicy.gatewayClients=[{"namespaceSelector":{}}]',
    )  # fmt: skip
    labels = _pod_labels(docs)
    pol = _policies(docs)
    agent_rules = pol["agent"]["ingress"]
    assert agent_rules[1]["ports"] == [{"protocol": "TCP", "port": 40001, "endPort": 40010}]
    assert _from_component(_allowed(pol["agent"], 40000), labels) == {"operator"}
    assert len(agent_rules) == 2  # no metrics port, no metrics rule
    assert _allowed(pol["gateway"], 8000) == [{"namespaceSelector": {}}]
    admin = _allowed(pol["gateway"], 9092)
    assert {"matchLabels": {"team": "obs"}} in [p.get("namespaceSelector") for p in admin]
    # Other gateway ports: the policy follows them, and the probes stay on the admin port.
    moved = _render(k8s_bin_dir, "--set", "gateway.port=8080", "--set", "gateway.adminPort=9300")
    gw_pol = _policies(moved)["gateway"]
    assert _allowed(gw_pol, 8080) == [{}] and _allowed(gw_pol, 8000) == []
    assert _from_component(_allowed(gw_pol, 9300), _pod_labels(moved)) == {"operator", PROMETHEUS}
    gw = _container(moved, *COMPONENTS["gateway"])
    named = {p["name"]: p["containerPort"] for p in gw["ports"]}
    assert named == {"http": 8080, "admin": 9300}
    assert named[gw["readinessProbe"]["httpGet"]["port"]] == 9300
    off = _render(k8s_bin_dir, "--set", "networkPolicy.enabled=false")
    assert not [d for d in off if d["kind"] == "NetworkPolicy"]
    bad = _helm(
        k8s_bin_dir, "template", "ws", str(CHART), "--set", "networkPolicy.enginePorts.from=5",
        "--set", "networkPolicy.enginePorts.to=4", check=False,
    )  # fmt: skip
    assert bad.returncode != 0 and "enginePorts.from must not be above" in bad.stderr


def test_the_api_server_stores_the_policies_as_rendered(
    k8s_control_plane: ControlPlane, k8s_namespace: str
) -> None:
    """Server-side apply of the rendered policies: the API server's validation accepts them
    and what it stores selects the same pods and ports (defaults filled in change nothing)."""
    rendered = k8s_control_plane.helm(
        "template", "ws", str(CHART), "--namespace", k8s_namespace
    ).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    k8s_control_plane.kubectl(
        "apply", "--server-side", "--validate=strict", "-n", k8s_namespace, "-f", "-",
        input=yaml.safe_dump_all(policies),
    )  # fmt: skip
    stored = json.loads(
        k8s_control_plane.kubectl("get", "networkpolicy", "-n", k8s_namespace, "-o", "json").stdout
    )["items"]
    assert sorted(p["metadata"]["name"] for p in stored) == sorted(
        p["metadata"]["name"] for p in policies
    )
    others = [d for d in docs if d["kind"] != "NetworkPolicy"]
    stored_docs = others + [{"kind": "NetworkPolicy", **p} for p in stored]
    assert _policies(stored_docs) == _policies(docs)


# ---- tenant RBAC on the real API server -----------------------------------------------------


def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


MODEL = {
    "apiVersion": "warmserve.io/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "chat"},
    "spec": {"model": {"name": "tiny-chat"}, "maxInstances": 2},
}


def test_a_tenant_editor_manages_model_deployments_but_never_their_status(
    k8s_controllers_plane: ControlPlane,
) -> None:
    plane = k8s_controllers_plane
    ns = plane.create_namespace("ws-rbac")
    tenant = plane.create_namespace("team-a")
    release = "r" + ns.rsplit("-", 1)[1]
    full = f"{release}-warmserve"
    try:
        plane.helm(
            "install", release, str(CHART), "--namespace", ns,
            "--set", f"operator.peering={ns}-peering",
        )  # fmt: skip

        def aggregated(role: str) -> bool:
            rules = json.loads(plane.kubectl("get", "clusterrole", role, "-o", "json").stdout)
            return any("warmserve.io" in r.get("apiGroups", []) for r in rules.get("rules") or [])

        for role in ("edit", "view", "admin"):
            _wait(lambda r=role: aggregated(r), 60, f"{full}-* aggregated into {role}")
        for sa, role in (("editor", "edit"), ("viewer", "view")):
            plane.kubectl("create", "serviceaccount", sa, "-n", tenant)
            plane.kubectl(
                "create", "rolebinding", sa, "-n", tenant, f"--clusterrole={role}",
                f"--serviceaccount={tenant}:{sa}",
            )  # fmt: skip
        editor = plane.sa_kubeconfig(tenant, "editor")
        viewer = plane.sa_kubeconfig(tenant, "viewer")

        def as_(kcfg: Path, *args: str, body: dict[str, Any] | None = None) -> Any:
            return plane.kubectl(
                *args, "-n", tenant, kubeconfig=kcfg, check=False,
                input=json.dumps(body) if body else None,
            )  # fmt: skip

        created = as_(editor, "create", "-f", "-", body=MODEL)
        assert created.returncode == 0, created.stderr
        patched = as_(editor, "patch", "modeldeployment", "chat", "--type=merge", "-p",
                      '{"spec":{"maxInstances":3}}')  # fmt: skip
        assert patched.returncode == 0, patched.stderr
        forged = as_(
            editor, "patch", "modeldeployment", "chat", "--subresource=status", "--type=merge",
            "-p", '{"status":{"readyInstances":5}}',
        )  # fmt: skip
        assert forged.returncode != 0 and "Forbidden" in forged.stderr, forged.stderr
        assert "modeldeployments/status" in forged.stderr
        can = as_(editor, "auth", "can-i", "patch", "modeldeployments", "--subresource=status")
        assert can.stdout.strip() == "no"
        elsewhere = plane.kubectl(
            "create", "-n", ns, "-f", "-", kubeconfig=editor, check=False,
            input=json.dumps(MODEL),
        )  # fmt: skip
        assert elsewhere.returncode != 0 and "Forbidden" in elsewhere.stderr
        assert as_(viewer, "get", "modeldeployment", "chat", "-o", "name").returncode == 0
        denied = as_(viewer, "delete", "modeldeployment", "chat")
        assert denied.returncode != 0 and "Forbidden" in denied.stderr
        assert as_(editor, "delete", "modeldeployment", "chat").returncode == 0
    finally:
        plane.helm("uninstall", release, "--namespace", ns, "--wait=false", check=False)
        for n in (tenant, ns):
            plane.kubectl("delete", "namespace", n, "--wait=false", check=False)


def test_an_upgrade_replaces_one_ca_certificates(
    k8s_control_plane: ControlPlane, k8s_namespace: str
) -> None:
    """Secrets of the older layout (one CA for both sides) are regenerated on upgrade; the new
    layout is kept across upgrades."""
    plane = k8s_control_plane
    release = "u" + k8s_namespace.rsplit("-", 1)[1]
    full = f"{release}-warmserve"
    peering = ["--set", f"operator.peering={k8s_namespace}-peering"]
    helm = lambda *a: plane.helm(*a, "--namespace", k8s_namespace)  # noqa: E731

    def certs() -> dict[str, str]:
        out = {}
        for side in ("agent-server", "operator-client"):
            s = json.loads(
                plane.kubectl(
                    "get", "secret", f"{full}-{side}-tls", "-n", k8s_namespace, "-o", "json"
                ).stdout
            )
            out[side] = s["data"]["tls.crt"]
        return out

    try:
        helm("install", release, str(CHART), *peering)
        first = certs()
        helm("upgrade", release, str(CHART), "--reuse-values")
        assert certs() == first
        for side in ("agent-server", "operator-client"):  # what an older chart wrote
            plane.kubectl(
                "annotate", "secret", f"{full}-{side}-tls", "-n", k8s_namespace,
                "warmserve.io/pki-",
            )  # fmt: skip
        helm("upgrade", release, str(CHART), "--reuse-values")
        renewed = certs()
        assert renewed["agent-server"] != first["agent-server"]
        assert renewed["operator-client"] != first["operator-client"]
    finally:
        helm("uninstall", release, "--wait=false")
