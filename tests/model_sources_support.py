"""Test servers for model sources: a local server speaking the Hugging Face Hub's file protocol,
and the real S3-compatible server (Versity S3 Gateway) built by ``hack/testbin/build.sh``.

**Hub protocol server** (``HubServer``).  No Hub server software can be installed here, so the
hf:// tests run ``huggingface_hub`` (the real client) against this server through its endpoint
setting (``HF_ENDPOINT``/``--hf-endpoint``).  It implements what the client calls, as the public
Hub answers it:

* ``GET /api/models/{repo}/revision/{rev}?blobs=true`` — ``sha`` (the commit) and ``siblings``
  with ``size``, ``blobId`` (git blob sha1) and ``lfs`` (``sha256``, ``size``, ``pointerSize``)
  for LFS files (here: ``*.safetensors``);
* ``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` — ``X-Repo-Commit``, ``ETag`` (git blob sha1,
  quoted); for LFS files a ``302`` to ``/lfs-cdn/{sha256}`` with ``X-Linked-Etag`` (the sha256)
  and ``X-Linked-Size``, as the Hub redirects LFS downloads to its CDN; ``Range`` requests
  (``206``); errors with ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``,
  ``EntryNotFound``) and 401 without a valid token when ``token`` is set.

Fault injection for the tests: ``corrupt[file] = n`` serves the first ``n`` downloads of that
file with one byte flipped (same size, so only a checksum can tell); ``rate`` throttles downloads
(bytes/s) so progress can be watched; ``cut_after[file] = n`` drops the connection of the next
GET of that file once its byte ``n`` is reached (a network cut midway); ``unavailable[file] = k``
answers the next ``k`` GETs of it with 503 (once a pending cut has happened).
``downloads[file]`` counts full GETs, ``ranges[file]`` the start of each ranged GET,
``served[file]`` the body bytes sent.

**S3 relay** (``S3Relay``).  A byte-level HTTP relay in front of the real S3 server, for faults
the server itself cannot produce: ``cut_after[key]``/``unavailable[key]`` as above for GetObject
(503 SlowDown), and ``list_rewrite`` to present a listing the way AWS S3 would list a key that
versitygw's posix backend cannot hold (it stores keys as file paths, so ``m//x`` becomes
``m/x``; AWS S3 keeps ``m//x`` as it is).  Requests and everything else pass through unchanged
(SigV4 signatures hold: the Host header is forwarded as sent).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import socket
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = ""
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag -> commit

    def __post_init__(self) -> None:
        if not self.commit:
            h = hashlib.sha1(usedforsecurity=False)
            for name in sorted(self.files):
                h.update(name.encode() + hashlib.sha256(self.files[name]).digest())
            self.commit = h.hexdigest()
        self.refs.setdefault("main", self.commit)


def repo_from_dir(path: Path) -> Repo:
    """A hub repo holding every file of a model directory (as ``write_model`` makes them)."""
    files = {
        p.relative_to(path).as_posix(): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }
    return Repo(files)


class HubServer:
    """``with HubServer({"org/name": repo}) as hub: hub.url``; see the module docstring."""

    def __init__(self, repos: dict[str, Repo], *, token: str = "", rate: float = 0.0) -> None:
        self.repos = repos
        self.token = token
        self.rate = rate  # bytes/s per download (0: unthrottled)
        self.corrupt: Counter[str] = Counter()
        self.downloads: Counter[str] = Counter()
        self.cut_after: dict[str, int] = {}
        self.unavailable: Counter[str] = Counter()
        self.ranges: defaultdict[str, list[int]] = defaultdict(list)
        self.served: Counter[str] = Counter()
        self.requests: list[tuple[str, str]] = []
        # The Hub and its LFS "CDN" on two origins, as on the real Hub: the client follows the
        # 302 only within the Hub and takes the file's metadata from the redirect itself.
        handler = self._handler()
        self._servers = [ThreadingHTTPServer(("127.0.0.1", 0), handler) for _ in range(2)]
        for srv in self._servers:
            srv.daemon_threads = True

    @staticmethod
    def _url_of(srv: ThreadingHTTPServer) -> str:
        host, port = srv.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def url(self) -> str:
        return self._url_of(self._servers[0])

    @property
    def cdn_url(self) -> str:
        return self._url_of(self._servers[1])

    def __enter__(self) -> HubServer:
        for srv in self._servers:
            threading.Thread(target=srv.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        for srv in self._servers:
            srv.shutdown()
            srv.server_close()

    def _blob(self, sha256: str) -> tuple[str, bytes] | None:
        for repo in self.repos.values():
            for name, data in repo.files.items():
                if hashlib.sha256(data).hexdigest() == sha256:
                    return name, data
        return None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _send(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD" and body:
                    self.wfile.write(body)

            def _error(self, code: int, error_code: str, message: str) -> None:
                body = json.dumps({"error": message}).encode()
                self._send(
                    code,
                    body,
                    {
                        "X-Error-Code": error_code,
                        "X-Error-Message": message,
                        "Content-Type": "application/json",
                    },
                )

            def _authorized(self) -> bool:
                if not hub.token:
                    return True
                return self.headers.get("authorization", "") == f"Bearer {hub.token}"

            def _repo(self, repo_id: str) -> Repo | None:
                repo = hub.repos.get(repo_id)
                if repo is None or not self._authorized():
                    self._error(401, "RepoNotFound", f"Repository Not Found for url: {self.path}")
                    return None
                return repo

            def do_HEAD(self) -> None:
                self.do_GET()

            def do_GET(self) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path))
                m = re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/(.+))?$", path)
                if m:
                    return self._info(m.group(1), m.group(2) or "main")
                m = re.match(r"^/lfs-cdn/([0-9a-f]{64})$", path)
                if m:
                    found = hub._blob(m.group(1))
                    if found is None:
                        return self._error(404, "EntryNotFound", "no such blob")
                    return self._file(found[0], found[1], {"ETag": f'"{m.group(1)}"'})
                m = re.match(r"^/([^/]+/[^/]+)/resolve/(.+?)/(.+)$", path)
                if m:
                    return self._resolve(m.group(1), m.group(2), m.group(3))
                self._error(404, "NotFound", f"no route {path}")

            def _commit(self, repo: Repo, rev: str) -> str | None:
                commit = repo.refs.get(rev, rev if rev == repo.commit else None)
                if commit is None:
                    self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return commit

            def _info(self, repo_id: str, rev: str) -> None:
                repo = self._repo(repo_id)
                if repo is None:
                    return
                commit = self._commit(repo, rev)
                if commit is None:
                    return
                siblings = []
                for name, data in sorted(repo.files.items()):
                    sib = {"rfilename": name, "size": len(data), "blobId": git_blob_sha1(data)}
                    if name.endswith(".safetensors"):
                        sib["lfs"] = {
                            "sha256": hashlib.sha256(data).hexdigest(),
                            "size": len(data),
                            "pointerSize": 134,
                        }
                    siblings.append(sib)
                body = json.dumps(
                    {"id": repo_id, "modelId": repo_id, "sha": commit, "siblings": siblings}
                ).encode()
                self._send(200, body, {"Content-Type": "application/json"})

            def _resolve(self, repo_id: str, rev: str, name: str) -> None:
                repo = self._repo(repo_id)
                if repo is None:
                    return
                commit = self._commit(repo, rev)
                if commit is None:
                    return
                data = repo.files.get(name)
                if data is None:
                    return self._error(404, "EntryNotFound", f"{name} not found")
                base = {"X-Repo-Commit": commit}
                if name.endswith(".safetensors"):  # LFS: redirect to the "CDN"
                    sha = hashlib.sha256(data).hexdigest()
                    return self._send(
                        302,
                        b"",
                        {
                            **base,
                            "Location": f"{hub.cdn_url}/lfs-cdn/{sha}",
                            "X-Linked-Etag": f'"{sha}"',
                            "X-Linked-Size": str(len(data)),
                            "ETag": f'"{git_blob_sha1(data)}"',
                        },
                    )
                self._file(name, data, {**base, "ETag": f'"{git_blob_sha1(data)}"'})

            def _file(self, name: str, data: bytes, headers: dict[str, str]) -> None:
                pending_cut = name in hub.cut_after
                if self.command == "GET" and hub.unavailable[name] > 0 and not pending_cut:
                    hub.unavailable[name] -= 1
                    return self._error(503, "ServiceUnavailable", "try again later")
                start, end, code = 0, len(data) - 1, 200
                rng = self.headers.get("range")
                if rng:
                    m = re.match(r"bytes=(\d+)-(\d*)", rng)
                    start = int(m.group(1)) if m else 0
                    end = min(int(m.group(2)) if m and m.group(2) else len(data) - 1, len(data) - 1)
                    code = 206
                    headers = {**headers, "Content-Range": f"bytes {start}-{end}/{len(data)}"}
                    if self.command == "GET":
                        hub.ranges[name].append(start)
                elif self.command == "GET":
                    hub.downloads[name] += 1
                    if hub.corrupt[name] > 0:
                        hub.corrupt[name] -= 1
                        data = bytearray(data)
                        data[len(data) // 2] ^= 0xFF
                        data = bytes(data)
                body = data[start : end + 1]
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                cut = hub.cut_after.pop(name, None)  # an absolute offset in the file
                step = 64 * 1024
                for i in range(0, len(body), step):
                    chunk = body[i : i + step]
                    if cut is not None and start + i + len(chunk) > cut:
                        keep = max(cut - start - i, 0)
                        self.wfile.write(chunk[:keep])
                        hub.served[name] += keep
                        self.wfile.flush()
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    self.wfile.write(chunk)
                    hub.served[name] += len(chunk)
                    if hub.rate:
                        time.sleep(step / hub.rate)

        return Handler


# ---- the real S3-compatible server ------------------------------------------------------------


class S3Relay:
    """``with S3Relay(upstream_url) as relay: relay.url``: see the module docstring."""

    def __init__(self, upstream: str) -> None:
        u = urlparse(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.cut_after: dict[str, int] = {}  # key -> byte offset (of the object) to cut at
        self.unavailable: Counter[str] = Counter()
        self.list_rewrite: Callable[[bytes], bytes] | None = None
        self.gets: list[tuple[str, str]] = []  # (key, Range header) of every GetObject
        self.served: Counter[str] = Counter()  # body bytes of GetObject sent per key
        self._srv = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._srv.daemon_threads = True

    @property
    def url(self) -> str:
        host, port = self._srv.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> S3Relay:
        threading.Thread(target=self._srv.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._srv.shutdown()
        self._srv.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                self._relay()

            def do_HEAD(self) -> None:
                self._relay()

            def do_PUT(self) -> None:
                self._relay()

            def _relay(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                path = urlparse(self.path)
                # Path-style: /BUCKET/KEY (the key as sent, '//' and all).
                key = unquote(path.path).split("/", 2)[2] if path.path.count("/") >= 2 else ""
                is_get = self.command == "GET" and key and "list-type" not in path.query
                if is_get:
                    relay.gets.append((key, self.headers.get("Range", "")))
                    if relay.unavailable[key] > 0 and key not in relay.cut_after:
                        relay.unavailable[key] -= 1
                        msg = b"<Error><Code>SlowDown</Code><Message>busy</Message></Error>"
                        self.send_response(503)
                        self.send_header("Content-Type", "application/xml")
                        self.send_header("Content-Length", str(len(msg)))
                        self.end_headers()
                        self.wfile.write(msg)
                        return
                conn = http.client.HTTPConnection(*relay.upstream, timeout=30)
                try:
                    conn.putrequest(
                        self.command, self.path, skip_host=True, skip_accept_encoding=True
                    )
                    for k, v in self.headers.items():
                        conn.putheader(k, v)
                    conn.endheaders(body or None)
                    resp = conn.getresponse()
                    data = resp.read()
                    headers = [
                        (k, v)
                        for k, v in resp.getheaders()
                        if k.lower() not in ("content-length", "transfer-encoding", "connection")
                    ]
                finally:
                    conn.close()
                if "list-type=2" in path.query and relay.list_rewrite is not None:
                    data = relay.list_rewrite(data)
                self.send_response(resp.status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                cut = relay.cut_after.pop(key, None) if is_get and resp.status < 300 else None
                if cut is not None:
                    start = 0
                    m = re.match(
                        r"bytes (\d+)-",
                        dict((k.lower(), v) for k, v in headers).get("content-range", ""),
                    )
                    if m:
                        start = int(m.group(1))
                    keep = max(cut - start, 0)
                    self.wfile.write(data[:keep])
                    relay.served[key] += keep
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(data)
                if is_get:
                    relay.served[key] += len(data)

        return Handler
