"""Small helpers shared by the engine tests."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def post_json(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    """POST ``body`` as JSON; (status, decoded JSON body), also for HTTP errors."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
