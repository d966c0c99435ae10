"""s3:// sources against a real S3-compatible server: the Versity S3 Gateway (posix backend),
built from the Go module proxy by hack/testbin/build.sh and cached like the control plane.

Objects are uploaded with boto3 the usual ways (a plain PUT, so the ETag is the MD5; a PUT
with a SHA-256 checksum; a multipart upload, whose ETag is not an MD5), then fetched by the
agent's fetcher.  A corrupted object (its bytes changed behind the gateway, in the backend
directory, so the listing still carries the original size and MD5) is refused after every
attempt; a missing prefix and bad credentials fail with clear messages.  A key that would write
outside the staging directory (``//``) or holds a backslash is refused, naming the key; a
download cut off midway is resumed by the next fetch with a ranged GET."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import write_model
from warmserve_agent.sources import SourceSettings, open_source
from warmserve_agent.sources.base import inspect
from warmserve_agent.sources.disk_reserve import DiskReserve
from warmserve_agent.sources.fetch_records import FetchFailed
from warmserve_agent.sources.fetcher import ModelFetcher
from warmserve_agent.store import WeightStore

from tests.model_sources_support import S3Relay
from warmserve.testing.testbin import built_server

boto3 = pytest.importorskip("boto3", reason="boto3 is part of the dev extra")

ACCESS, SECRET = "warmserve-test", "warmserve-test-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """(endpoint URL, backend directory) of a running versitygw."""
    binary = built_server("versitygw")
    data = tmp_path_factory.mktemp("s3data")
    port = _free_port()
    proc = subprocess.Popen(
        [
            str(binary),
            "--access",
            ACCESS,
            "--secret",
            SECRET,
            "--port",
            f"127.0.0.1:{port}",
            "--quiet",
            "posix",
            str(data),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            if proc.poll() is not None:
                err = proc.stderr.read().decode()[-2000:]
                raise RuntimeError(f"versitygw exited: {err}") from None
            time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError("versitygw did not start listening in 30 s")
    try:
        yield url, data
    finally:
        proc.terminate()
        proc.wait(10)


def client(url: str, **config):
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id=ACCESS,
        aws_secret_access_key=SECRET,
        config=Config(**config),
    )


@pytest.fixture(autouse=True)
def creds(monkeypatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def upload(url: str, bucket: str, prefix: str, model_dir: Path) -> None:
    from boto3.s3.transfer import TransferConfig

    c = client(url)
    with contextlib.suppress(c.exceptions.BucketAlreadyOwnedByYou):
        c.create_bucket(Bucket=bucket)
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    for i, p in enumerate(files):
        key = f"{prefix}/{p.name}"
        if p.name == "config.json":
            # As an older tool uploads it: no checksum stored, only the MD5 ETag.
            plain = client(url, request_checksum_calculation="when_required")
            plain.put_object(Bucket=bucket, Key=key, Body=p.read_bytes())
        elif i % 2:
            c.put_object(Bucket=bucket, Key=key, Body=p.read_bytes(), ChecksumAlgorithm="SHA256")
        else:  # multipart: ETag is not an MD5 (size is still checked)
            c.upload_file(
                str(p),
                bucket,
                key,
                Config=TransferConfig(
                    multipart_threshold=5 * 1024**2, multipart_chunksize=5 * 1024**2
                ),
            )


def fetcher(root: Path, url: str, **kw) -> ModelFetcher:
    root.mkdir(parents=True, exist_ok=True)
    # No disk reserve unless a test sets one: the machine's free disk is not what it tests.
    kw.setdefault("reserve", DiskReserve(0.0, 0))
    return ModelFetcher(
        WeightStore(root),
        SourceSettings(s3_endpoint_url=url, s3_region="us-east-1", timeout_s=10),
        lock=threading.RLock(),
        in_use=lambda: set(),
        backoff_s=0.05,
        **kw,
    )


def run(f: ModelFetcher, model: str, uri: str) -> None:
    job = f.ensure(model, uri)
    assert job.wait(120)
    if job.error:
        raise job.error


def test_s3_fetch_from_a_real_s3_server(s3, tmp_path: Path) -> None:
    url, _ = s3
    # hidden=1300: a ~11 MiB shard, uploaded in multipart
    src = write_model(tmp_path / "up", "llama", layers=2, hidden=1300, files=2)
    upload(url, "models", "meta/llama", src)
    facts = inspect(open_source("s3://models/meta/llama", SourceSettings(s3_endpoint_url=url)))
    ref = WeightStore(tmp_path / "up").model("llama")
    assert (facts.num_layers, facts.weight_bytes) == (2, ref.weight_bytes)
    listing = open_source(
        "s3://models/meta/llama", SourceSettings(s3_endpoint_url=url)
    ).list_files()
    checks = {f.path: f.checks() for f in listing.files}
    assert checks["config.json"] == "size+md5"
    assert any("sha256" in c for c in checks.values()), checks
    f = fetcher(tmp_path / "store", url)
    run(f, "meta/llama", "s3://models/meta/llama")
    got = f.store.model("meta/llama")
    assert (got.num_layers, got.weight_bytes) == (2, ref.weight_bytes)
    for t in ref.tensors:
        assert (f.store.model_path("meta/llama") / t.file.name).read_bytes() == t.file.read_bytes()
    f.close()


def test_s3_corrupted_object_is_refused_after_every_attempt(s3, tmp_path: Path) -> None:
    url, data = s3
    src = write_model(tmp_path / "up", "m", layers=2, hidden=32, files=1)
    upload(url, "models", "corrupt/m", src)
    # Change the objects' bytes behind the gateway (same size): the listing still carries the
    # MD5/SHA-256 of what was uploaded, so the downloads cannot pass their checks.  config.json
    # (stored without a checksum) is caught by our MD5 check; the shard (stored with a SHA-256)
    # already by botocore's own response check.
    for name in ("config.json", "model-00001-of-00001.safetensors"):
        obj = data / "models" / "corrupt" / "m" / name
        raw = bytearray(obj.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        obj.write_bytes(bytes(raw))
    f = fetcher(tmp_path / "store", url, attempts=2)
    with pytest.raises(FetchFailed, match="failed after 2 attempts") as exc:
        run(f, "m", "s3://models/corrupt/m")
    assert "config.json: md5 " in exc.value.message
    assert "model-00001-of-00001.safetensors: checksum mismatch" in exc.value.message
    assert f.stats["retries:checksum"] == 4  # two files, two attempts each
    assert not f.store.has("m")
    f.close()


def test_s3_missing_prefix_and_bad_credentials(s3, tmp_path: Path, monkeypatch) -> None:
    url, _ = s3
    f = fetcher(tmp_path / "store", url)
    with pytest.raises(FetchFailed, match="no objects under s3://models/nothing/"):
        run(f, "x", "s3://models/nothing/here")
    with pytest.raises(FetchFailed, match="not found"):
        run(f, "y", "s3://no-such-bucket/x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    g = fetcher(tmp_path / "store2", url)
    with pytest.raises(FetchFailed, match=r"access denied|SignatureDoesNotMatch"):
        run(g, "z", "s3://models/meta/llama")
    f.close()
    g.close()


# ---- keys that would leave the staging directory; resume -------------------------------------
def _encodings(key: str) -> list[str]:
    from urllib.parse import quote

    return [key, quote(key, safe="/"), quote(key, safe="")]


def test_a_key_with_a_double_slash_cannot_write_outside_staging(s3, tmp_path: Path) -> None:
    """``PREFIX//abs/path``: the part below ``PREFIX/`` is an absolute path, and joining it to
    the staging directory used to write there: over another model's files in the store.

    versitygw's posix backend stores keys as file paths (``m//x`` is kept as ``m/x``), so a relay
    in front of it lists the object under the key AWS S3 would keep: ``evil/m//<victim path>``;
    the object itself (and every GET) is the real server's."""
    url, _ = s3
    src = write_model(tmp_path / "up", "llama", layers=2, hidden=32, files=1)
    (src / "chat_template.jinja").write_text("{{ messages }}")
    upload(url, "models", "team-a/llama", src)
    f = fetcher(tmp_path / "store", url)
    run(f, "team-a/llama", "s3://models/team-a/llama")
    victim = f.store.model_path("team-a/llama") / "chat_template.jinja"
    assert victim.read_text() == "{{ messages }}"
    f.close()
    evil = write_model(tmp_path / "up2", "m", layers=2, hidden=32, files=1)
    upload(url, "models", "evil/m", evil)
    stored = "evil/m/" + str(victim).lstrip("/")  # how versitygw holds "evil/m/" + str(victim)
    client(url).put_object(Bucket="models", Key=stored, Body=b"{{ pwned }}")
    with S3Relay(url) as relay:

        def as_aws_lists_it(xml: bytes) -> bytes:
            text = xml.decode()
            for a, b in zip(_encodings(stored), _encodings("evil/m/" + str(victim)), strict=True):
                text = text.replace(f"<Key>{a}</Key>", f"<Key>{b}</Key>")
            return text.encode()

        relay.list_rewrite = as_aws_lists_it
        g = fetcher(tmp_path / "store", relay.url)
        with pytest.raises(FetchFailed) as exc:
            run(g, "evil", "s3://models/evil/m")
        g.close()
    msg = exc.value.message
    assert exc.value.code == "FAILED_PRECONDITION"
    assert f"object key 'evil/m/{victim}'" in msg, msg  # the key, '//' and all
    assert "its path is absolute" in msg
    assert victim.read_text() == "{{ messages }}"
    assert not any(k.startswith("evil/") for k, _ in relay.gets)  # refused before any GET


def test_a_key_with_a_backslash_is_refused(s3, tmp_path: Path) -> None:
    url, _ = s3
    src = write_model(tmp_path / "up", "m", layers=2, hidden=32, files=1)
    upload(url, "models", "bs/m", src)
    client(url).put_object(Bucket="models", Key="bs/m/tok\\..\\x.json", Body=b"{}")
    f = fetcher(tmp_path / "store", url)
    with pytest.raises(FetchFailed, match=r"object key 'bs/m/tok.*contains a backslash"):
        run(f, "bs", "s3://models/bs/m")
    f.close()


def test_an_s3_download_cut_midway_is_resumed_by_the_next_fetch(s3, tmp_path: Path) -> None:
    url, _ = s3
    src = write_model(tmp_path / "up", "m", layers=2, hidden=700, files=1)
    shard = "model-00001-of-00001.safetensors"
    data = (src / shard).read_bytes()
    c = client(url)
    with contextlib.suppress(c.exceptions.BucketAlreadyOwnedByYou):
        c.create_bucket(Bucket="models")
    for p in src.iterdir():
        c.put_object(Bucket="models", Key=f"res/m/{p.name}", Body=p.read_bytes())
    key = f"res/m/{shard}"
    half = len(data) // 2
    store = tmp_path / "store"
    with S3Relay(url) as relay:
        relay.cut_after[key] = half  # the connection drops at half the object
        relay.unavailable[key] = 10  # and the server is busy for a while after
        first = fetcher(store, relay.url, attempts=1)
        with pytest.raises(FetchFailed) as exc:
            run(first, "res", "s3://models/res/m")
        assert exc.value.code == "UNAVAILABLE", exc.value.message
        first.close()
        kept = (store / ".warmserve-staging" / "res" / shard).stat().st_size
        assert 0 < kept <= half
        relay.unavailable.clear()
        relay.served.clear()
        relay.gets.clear()
        second = fetcher(store, relay.url)  # as after an agent restart
        run(second, "res", "s3://models/res/m")
        assert relay.gets == [(key, f"bytes={kept}-")]
        assert relay.served[key] == len(data) - kept
        assert (second.store.model_path("res") / shard).read_bytes() == data
        second.close()
