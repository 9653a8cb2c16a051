"""S3 access shared by sources, snapshots and sinks: an ``s3://bucket/prefix``
location, one way to make a boto3 client, and one endpoint description (URL,
credentials, region) rendered for each client that talks to it: delta-rs storage
options, pyiceberg FileIO properties, boto3.

S3-compatible servers (SeaweedFS, MinIO, R2) need path-style addressing, plain
HTTP allowed, and for Delta a way to make the commit file creation exclusive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from volley_dagster.errors import ConfigError


@dataclass(frozen=True)
class S3Location:
    """``s3://bucket/prefix`` (or ``s3a://``), parsed once."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        parsed = urlparse(uri)
        if parsed.scheme not in ("s3", "s3a") or not parsed.netloc:
            raise ConfigError(f"not an S3 URI: {uri!r} (expected s3://bucket/prefix)")
        return cls(parsed.netloc, parsed.path.strip("/"))

    def key(self, path: str) -> str:
        """The object key of ``path`` under the prefix."""
        return f"{self.prefix}/{path}" if self.prefix else path

    def url(self, path: str) -> str:
        return f"s3://{self.bucket}/{self.key(path)}"


def s3_client(options: dict[str, Any] | None = None, *, max_attempts: int = 5, max_pool_connections: int = 10) -> Any:
    """A boto3 S3 client with path-style addressing (S3-compatible servers need it) and
    standard retries. ``options``: ``boto3.client`` keyword arguments (an endpoint's
    ``boto3_options()``; unset ones come from the usual AWS environment). Made from its
    own session: the default session is not thread-safe to create clients from."""
    import boto3
    from botocore.config import Config

    config = Config(s3={"addressing_style": "path"}, max_pool_connections=max_pool_connections,
                    retries={"max_attempts": max_attempts, "mode": "standard"})
    return boto3.session.Session().client("s3", **{"config": config, **(options or {})})


_MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound", "NoSuchBucket"})
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "503", "500", "502", "504",
})


def s3_error_code(exc: BaseException) -> str:
    """The S3 error code of a botocore ``ClientError`` ("" for other errors)."""
    response = getattr(exc, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def is_missing(exc: BaseException) -> bool:
    """The object or bucket does not exist: an answer, not an outage."""
    return s3_error_code(exc) in _MISSING_CODES


def is_transient(exc: BaseException) -> bool:
    """An S3 outage rather than an answer: a refused or reset connection, a timeout,
    5xx or throttling (botocore's own retries are spent when this reaches us)."""
    from botocore.exceptions import BotoCoreError, ConnectionError, HTTPClientError

    if isinstance(exc, (ConnectionError, HTTPClientError)):  # refused, reset, read and connect timeouts
        return True
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        return status >= 500 or s3_error_code(exc) in _TRANSIENT_CODES
    return isinstance(exc, (BotoCoreError, OSError, TimeoutError))


@dataclass(frozen=True)
class S3Endpoint:
    endpoint_url: str
    access_key_id: str
    secret_access_key: str
    region: str = "us-east-1"
    # How delta-rs makes ``_delta_log/N.json`` creation exclusive: "etag" uses the
    # store's conditional PUT (If-None-Match: *), which SeaweedFS, MinIO and R2
    # honour; None falls back to delta-rs' default (a DynamoDB lock, or
    # ``unsafe_rename``, which lets two racing writers both "win" a version).
    conditional_put: str | None = "etag"
    unsafe_rename: bool = False

    @property
    def allow_http(self) -> bool:
        return self.endpoint_url.startswith("http://")

    def delta_storage_options(self) -> dict[str, str]:
        """delta-rs (object_store) ``storage_options``."""
        opts = {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_REGION": self.region,
            "AWS_ALLOW_HTTP": "true" if self.allow_http else "false",
            "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false",
        }
        if self.conditional_put:
            opts["aws_conditional_put"] = self.conditional_put
        if self.unsafe_rename:
            opts["AWS_S3_ALLOW_UNSAFE_RENAME"] = "true"
        return opts

    def iceberg_properties(self) -> dict[str, str]:
        """pyiceberg catalog/FileIO properties (PyArrowFileIO reads ``s3.*``; the
        path-style flag is for Java/REST catalogs sharing the config: pyarrow's
        S3 filesystem already uses path style with an endpoint override)."""
        return {
            "s3.endpoint": self.endpoint_url,
            "s3.access-key-id": self.access_key_id,
            "s3.secret-access-key": self.secret_access_key,
            "s3.region": self.region,
            "s3.path-style-access": "true",
        }

    def boto3_options(self) -> dict[str, Any]:
        """``boto3.client("s3", **options)`` keyword arguments (as S3Storage takes)."""
        return {
            "endpoint_url": self.endpoint_url,
            "aws_access_key_id": self.access_key_id,
            "aws_secret_access_key": self.secret_access_key,
            "region_name": self.region,
        }
