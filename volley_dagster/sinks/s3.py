"""One S3 endpoint description (URL, credentials, region) rendered for each client
that talks to it: delta-rs storage options, pyiceberg FileIO properties, boto3.

S3-compatible servers (SeaweedFS, MinIO, R2) need path-style addressing, plain
HTTP allowed, and for Delta a way to make the commit file creation exclusive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
