"""``s3://BUCKET/PREFIX``: a model's files under a prefix of an S3(-compatible) bucket, via boto3.

* Listing: ``ListObjectsV2`` under ``PREFIX/``; the model's files are the keys below it.  Every
  key's path below the prefix is checked (:func:`~warmserve_agent.sources.base.check_remote_path`):
  a key with ``//`` (``PREFIX//abs/path``), ``.``/``..`` segments, a backslash or NUL makes the
  whole listing refused, naming the key.
* Downloads: ``GetObject`` streamed into the file the fetcher opened, with ``If-Match`` the
  listed ETag (bytes of another version of the object are never mixed in) and, for a resumed
  file, ``Range: bytes=N-`` from the bytes already on disk.
* Checks: the size from the listing always; the object's MD5 when its ETag is one (single-part
  uploads: a plain 32-hex ETag); the object's full SHA-256 when it was stored with one
  (``x-amz-checksum-sha256``, asked for with ``ChecksumMode=ENABLED``; botocore also checks a
  stored checksum itself while a whole object streams).  A multipart ETag (``…-N``) is not an MD5
  and is not checked.
* Credentials: boto3's standard chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, a shared
  credentials file, IRSA/web identity); ``--s3-endpoint-url`` for S3-compatible stores.
* boto3 is the optional extra ``warmserve[s3]`` (in the agent image); without it an ``s3://``
  source is refused with that hint.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from warmserve.modelref import S3Ref
from warmserve_agent.sources.base import (
    Listing,
    RemoteFile,
    SourceError,
    SourceSettings,
    check_remote_path,
    exact_range,
    select,
)
from warmserve_agent.sources.fetch_records import FetchFailed

_MD5_ETAG = re.compile(r'^"?([0-9a-fA-F]{32})"?$')


def _boto3() -> Any:
    try:
        import boto3
    except ImportError as exc:
        raise SourceError(
            "s3:// sources need boto3: install warmserve[s3] (the agent image has it)"
        ) from exc
    return boto3


class S3Source:
    in_place = False

    def __init__(self, ref: S3Ref, settings: SourceSettings, uri: str) -> None:
        self.ref = ref
        self.uri = uri
        self.settings = settings
        self._client: Any = None

    def _s3(self) -> Any:
        if self._client is None:
            from botocore.config import Config

            kw: dict[str, Any] = {
                "config": Config(
                    connect_timeout=self.settings.timeout_s,
                    read_timeout=self.settings.timeout_s,
                    retries={"max_attempts": 3, "mode": "standard"},
                )
            }
            if self.settings.s3_endpoint_url:
                kw["endpoint_url"] = self.settings.s3_endpoint_url
            if self.settings.s3_region:
                kw["region_name"] = self.settings.s3_region
            self._client = _boto3().session.Session().client("s3", **kw)
        return self._client

    def _error(self, exc: Exception, what: str) -> SourceError:
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            FlexibleChecksumError,
            NoCredentialsError,
        )

        if isinstance(exc, FlexibleChecksumError):  # botocore checked the object's checksum
            return SourceError(
                f"{what.removeprefix(self.uri + ' ')}: checksum mismatch: {exc}",
                retryable=True,
                checksum=True,
            )
        if isinstance(exc, NoCredentialsError):
            return SourceError(
                f"{what}: no S3 credentials (set agent.modelSources.s3.secretName or the "
                "agent's AWS_* environment)"
            )
        if isinstance(exc, ClientError):
            code = exc.response.get("Error", {}).get("Code", "")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code == "PreconditionFailed" or status == 412:
                return SourceError(
                    f"{what}: the object changed since it was listed; the next fetch lists it again"
                )
            if code in ("NoSuchBucket", "NoSuchKey", "404") or status == 404:
                return SourceError(f"{what}: not found ({code or status})")
            if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId"):
                return SourceError(f"{what}: access denied ({code}); check the S3 credentials")
            return SourceError(f"{what}: {code or status}: {exc}", retryable=status >= 500)
        if isinstance(exc, BotoCoreError | OSError):
            return SourceError(f"{what}: {exc}", retryable=True)
        return SourceError(f"{what}: {type(exc).__name__}: {exc}")

    def _key(self, path: str) -> str:
        return f"{self.ref.prefix}/{path}"

    def list_files(self) -> Listing:
        prefix = self.ref.prefix + "/"
        files = []
        try:
            pages = (
                self._s3()
                .get_paginator("list_objects_v2")
                .paginate(Bucket=self.ref.bucket, Prefix=prefix)
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    key = str(obj["Key"])
                    if not key.startswith(prefix):
                        raise SourceError(f"{self.uri}: listed key {key[:200]!r} is not under it")
                    rel = key[len(prefix) :]
                    if not rel:
                        continue  # the prefix's own folder marker
                    check_remote_path(
                        rel.removesuffix("/"), f"{self.uri}: object key {key[:200]!r}"
                    )
                    if rel.endswith("/"):
                        continue  # a folder marker: no file
                    etag = str(obj.get("ETag", ""))
                    m = _MD5_ETAG.match(etag)
                    files.append(
                        RemoteFile(
                            rel,
                            int(obj["Size"]),
                            md5=m.group(1).lower() if m else "",
                            etag=etag,
                        )
                    )
        except SourceError:
            raise
        except Exception as exc:
            raise self._error(exc, self.uri) from None
        if not files:
            raise SourceError(f"{self.uri}: no objects under s3://{self.ref.bucket}/{prefix}")
        chosen = select(files, self.uri)
        # Full-object SHA-256s, when the objects were stored with one (one HEAD per file).
        out = []
        for f in chosen:
            try:
                head = self._s3().head_object(
                    Bucket=self.ref.bucket, Key=self._key(f.path), ChecksumMode="ENABLED"
                )
            except Exception as exc:
                raise self._error(exc, f"{self.uri} {f.path}") from None
            sha = head.get("ChecksumSHA256", "")
            if sha and head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT" and "-" not in sha:
                f = RemoteFile(
                    f.path, f.size, sha256=base64.b64decode(sha).hex(), md5=f.md5, etag=f.etag
                )
            out.append(f)
        return Listing(tuple(out), revision="")

    def download(self, f: RemoteFile, out: BinaryIO, start: int, listing: Listing) -> None:
        what = f"{self.uri} {f.path}"
        kw: dict[str, Any] = {"Bucket": self.ref.bucket, "Key": self._key(f.path)}
        if f.etag:
            kw["IfMatch"] = f.etag
        if start:
            kw["Range"] = f"bytes={start}-"
        else:  # the whole object: botocore checks its stored checksum as it streams
            kw["ChecksumMode"] = "ENABLED"
        try:
            obj = self._s3().get_object(**kw)
        except Exception as exc:
            raise self._error(exc, what) from None
        if start and not obj.get("ContentRange"):  # the range was ignored: the whole object
            out.seek(0)
            out.truncate()
        for chunk in self._chunks(obj["Body"], what):
            out.write(chunk)  # outside the try: the disk guard's refusal is not an S3 error

    def _chunks(self, body: Any, what: str) -> Iterator[bytes]:
        it = body.iter_chunks(1024 * 1024)
        while True:
            try:
                chunk = next(it)
            except StopIteration:
                return
            except (SourceError, FetchFailed):
                raise
            except Exception as exc:  # a dropped connection, a short body, a bad checksum
                raise self._error(exc, what) from None
            yield chunk

    def read_range(self, path: str, start: int, length: int, listing: Listing) -> bytes:
        try:
            obj = self._s3().get_object(
                Bucket=self.ref.bucket,
                Key=self._key(path),
                Range=f"bytes={start}-{start + length - 1}",
            )
            data = obj["Body"].read()
        except Exception as exc:
            raise self._error(exc, f"{self.uri} {path}") from None
        return exact_range(data, f"{self.uri} {path}", start, length)

    def location(self) -> Path:
        raise NotImplementedError("s3:// sources are downloaded, not linked")
