"""An external metrics API server for the HPA end-to-end test.

In a cluster, the HPA controller reads External metrics from whatever serves the aggregated API
``external.metrics.k8s.io/v1beta1`` (KEDA's metrics server, prometheus-adapter). Here this small
HTTPS server serves that API from values the test sets: it stands in for Prometheus plus its
adapter, i.e. for the answer of a query such as
``sum(warmserve_gateway_held_requests{model="tiny-chat"})``. Everything between it and the
ModelDeployment is real: the kube-apiserver's aggregator proxies to it (an ``APIService`` and an
``ExternalName`` Service naming 127.0.0.1, so no kube-proxy or endpoints are needed), and
kube-controller-manager's HPA controller reads it and writes the scale subresource.

TLS is verified, not skipped: the aggregator checks the server's certificate for the Service's
DNS name (``<service>.<namespace>.svc``), so the server gets one for that name, signed with the
control plane's CA (``openssl``, as ``hack/k8s/mkcerts.sh`` does), and the APIService trusts
that CA.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import ssl
import subprocess
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

GROUP = "external.metrics.k8s.io"
VERSION = "v1beta1"
GV = f"{GROUP}/{VERSION}"


class ExternalMetrics:
    """Metric values by (namespace, name): a list of (labels, value) series."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str], list[tuple[dict[str, str], float]]] = {}
        self.reads: list[tuple[str, str, str]] = []  # (namespace, metric, labelSelector) asked

    def set(self, namespace: str, metric: str, labels: dict[str, str], value: float) -> None:
        with self._lock:
            series = [s for s in self._series.get((namespace, metric), []) if s[0] != labels]
            self._series[(namespace, metric)] = [*series, (dict(labels), value)]

    def query(self, namespace: str, metric: str, selector: str) -> list[dict[str, Any]]:
        want = _parse_selector(selector)
        now = dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
        with self._lock:
            self.reads.append((namespace, metric, selector))
            series = list(self._series.get((namespace, metric), []))
        return [
            {
                "metricName": metric,
                "metricLabels": labels,
                "timestamp": now,
                # a Kubernetes quantity: milli-units keep fractions exact
                "value": f"{round(value * 1000)}m",
            }
            for labels, value in series
            if all(labels.get(k) == v for k, v in want.items())
        ]


def _parse_selector(selector: str) -> dict[str, str]:
    """Equality selectors (``a=b,c==d``), which is what the HPA sends for ``matchLabels``."""
    out: dict[str, str] = {}
    for part in filter(None, selector.split(",")):
        key, sep, value = part.replace("==", "=").partition("=")
        if not sep or key.endswith("!"):
            raise ValueError(f"unsupported selector term {part!r}")
        out[key.strip()] = value.strip()
    return out


def _handler(metrics: ExternalMetrics) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet: the test prints reads
            pass

        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            parts = url.path.strip("/").split("/")
            if parts == ["apis", GROUP, VERSION]:
                self._send(
                    200,
                    {
                        "kind": "APIResourceList",
                        "apiVersion": "v1",
                        "groupVersion": GV,
                        "resources": [
                            {
                                "name": "externalmetrics",
                                "singularName": "",
                                "namespaced": True,
                                "kind": "ExternalMetricValueList",
                                "verbs": ["get"],
                            }
                        ],
                    },
                )
                return
            if (
                len(parts) == 6
                and parts[:3] == ["apis", GROUP, VERSION]
                and parts[3] == "namespaces"
            ):
                selector = urllib.parse.parse_qs(url.query).get("labelSelector", [""])[0]
                try:
                    items = metrics.query(parts[4], parts[5], selector)
                except ValueError as exc:
                    self._send(400, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                     "message": str(exc), "code": 400})  # fmt: skip
                    return
                self._send(
                    200,
                    {"kind": "ExternalMetricValueList", "apiVersion": GV, "metadata": {},
                     "items": items},
                )  # fmt: skip
                return
            self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                             "reason": "NotFound", "code": 404})  # fmt: skip

    return Handler


def _serving_cert(pki: Path, out: Path, dns: str) -> tuple[Path, Path]:
    """A key and a certificate for ``dns``, signed with the control plane's CA."""
    out.mkdir(parents=True, exist_ok=True)
    key, csr, crt, ext = (out / f"metrics.{x}" for x in ("key", "csr", "crt", "ext"))
    ext.write_text(f"subjectAltName=DNS:{dns}\nextendedKeyUsage=serverAuth\n")
    for argv in (
        ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
         "-subj", f"/CN={dns}"],
        ["openssl", "x509", "-req", "-in", str(csr), "-CA", str(pki / "ca.crt"), "-CAkey",
         str(pki / "ca.key"), "-CAcreateserial", "-CAserial", str(out / "ca.srl"), "-out",
         str(crt), "-days", "1", "-extfile", str(ext)],
    ):  # fmt: skip
        subprocess.run(argv, check=True, capture_output=True, timeout=60)
    return crt, key


@contextmanager
def serve_external_metrics(
    pki: Path, workdir: Path, kubectl: Callable[..., Any], namespace: str
) -> Iterator[ExternalMetrics]:
    """Serve :class:`ExternalMetrics` on 127.0.0.1 and register it as ``v1beta1.external.
    metrics.k8s.io`` (cluster-wide: at most one per control plane at a time); unregistered after.
    """
    metrics = ExternalMetrics()
    service = "external-metrics"
    crt, key = _serving_cert(pki, workdir, f"{service}.{namespace}.svc")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(metrics))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(crt), str(key))
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    objects = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": service, "namespace": namespace},
            "spec": {"type": "ExternalName", "externalName": "127.0.0.1"},
        },
        {
            "apiVersion": "apiregistration.k8s.io/v1",
            "kind": "APIService",
            "metadata": {"name": f"{VERSION}.{GROUP}"},
            "spec": {
                "group": GROUP,
                "version": VERSION,
                "service": {"name": service, "namespace": namespace, "port": port},
                "caBundle": base64.b64encode((pki / "ca.crt").read_bytes()).decode(),
                "groupPriorityMinimum": 100,
                "versionPriority": 100,
            },
        },
    ]
    try:
        kubectl(
            "apply", "-f", "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}),
        )  # fmt: skip
        kubectl(
            "wait", "--for=condition=Available", "--timeout=60s", f"apiservice/{VERSION}.{GROUP}"
        )
        yield metrics
    finally:
        kubectl("delete", "apiservice", f"{VERSION}.{GROUP}", "--ignore-not-found", check=False)
        server.shutdown()
        server.server_close()
