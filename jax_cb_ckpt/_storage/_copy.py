"""Server-side copies: one object of a bucket copied to a new name in the same bucket by
the server itself (GCS's `objects.rewrite`, S3's `CopyObject`), its bytes never passing
through this process. `BucketChunks.link` is one (a later save links a step's unchanged
files from the step before it).

TensorStore, which does every other request (`_remote`), sends neither request, so
these go through the providers' own client libraries, optional extras imported at the
first copy: `google-cloud-storage` for gs:// (`pip install 'jax-cb-ckpt[gcs]'`),
`boto3` for s3:// (`jax-cb-ckpt[s3]`); without it a copy is a `ConfigError` that says
so. This package still handles no credentials: each library finds them in the standard
environment, as TensorStore does (application-default credentials; AWS's chain), and
the endpoints are `_remote`'s variables: `STORAGE_EMULATOR_HOST` (then anonymous
credentials: an emulator checks none), `AWS_ENDPOINT_URL_S3`/`AWS_ENDPOINT_URL`,
`AWS_REGION`/`AWS_DEFAULT_REGION`. One client per process and configuration, shared
by every thread (both libraries' clients are thread-safe).

The target is created only if absent: its name is asked first (a `FileExistsError`
when it is there; the emulators of the tests ignore the precondition below), and the
copy itself carries the create-only precondition (GCS `ifGenerationMatch=0`, S3
`If-None-Match: *`), which closes the race where the server honours it (GCS does; S3
does on `CopyObject`, and on the `CompleteMultipartUpload` of a larger copy).

S3 copies at most 5 GiB in one request; a larger object is copied part by part
(`UploadPartCopy`, each part conditioned on the source's ETag, so that a source
replaced meanwhile fails the copy instead of mixing two), then completed.

Bounded as `_remote`'s operations: a connection is given up after 6 s, a request that
gets no byte for 10 s too, transient errors (429, 5xx, a reset or refused connection, a
timeout) are retried with backoff (GCS: for 20 s, 1 s doubling to 8 s; S3: 3 tries,
AWS's standard mode), and a copy against a dead or hung server fails within ~40 s
with a `StorageError` whose text is scrubbed (`_faults.scrub`).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from .._base._errors import ConfigError, where
from ._faults import StorageError, scrub
from ._remote import split

_CONNECT_S = 6  # a connection not made in this time is given up (and retried)
_READ_S = 10  # a request that receives no byte for this long is given up (and retried)
_GCS_RETRY_S = 20  # GCS: transient errors retried (1 s doubling to 8 s) for this long
_S3_ATTEMPTS = 3  # S3: tries of one request (AWS's standard mode: backoff up to 2, 4 s)
_POOL = 32  # connections kept per client (the caller links from a thread pool)
COPY_MAX_BYTES = 5 << 30  # S3's largest object that one CopyObject copies
PART_BYTES = 512 << 20  # S3: the part of a larger copy (at most 10,000 parts)
_MAX_PARTS = 10_000

_LIBRARIES = {"gs": ("google-cloud-storage", "gcs"), "s3": ("boto3", "s3")}
_CLIENTS: dict[tuple[str, ...], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def copy(source: str, target: str) -> None:
    """The object `target` (a URL) made a copy of the object `source` (a URL in the
    same bucket) by the server. `FileNotFoundError` when `source` is not there,
    `FileExistsError` when `target` is (nothing copied), `ConfigError` when the
    scheme's client library is not installed, `StorageError` for any other failure
    (after the retries)."""
    scheme, bucket, source_key = split(source)
    target_scheme, target_bucket, target_key = split(target)
    if (target_scheme, target_bucket) != (scheme, bucket):
        raise ValueError(f"a server-side copy stays in its bucket: {source} -> {target}")
    if scheme == "gs":
        _gcs_copy(bucket, source_key, target_key, source, target)
    else:
        _s3_copy(bucket, source_key, target_key, source, target)


def check_library(url: str) -> None:
    """`ConfigError` (`_missing_library`) when the client library that copies in the
    bucket of `url` is not installed: asked once, before any step links."""
    scheme = split(url)[0]
    try:
        __import__("google.cloud.storage" if scheme == "gs" else "boto3")
    except ImportError:
        raise _missing_library(scheme) from None


def _missing_library(scheme: str) -> ConfigError:
    package, extra = _LIBRARIES[scheme]
    return ConfigError(
        f"{where()}: a link in {'an' if scheme == 's3' else 'a'} {scheme}:// bucket is a "
        "server-side copy, made with "
        f"{package}, which is not installed. Fix: pip install 'jax-cb-ckpt[{extra}]'"
    )


def _failed(source: str, target: str, e: BaseException) -> StorageError:
    """The `StorageError` of a copy the library failed with `e`, its text scrubbed
    (raised `from None`: `e`'s own text may hold what the server echoed)."""
    return StorageError(f"copying {source} to {target} failed: {scrub(f'{type(e).__name__}: {e}')}")


def _cached(key: tuple[str, ...], make: Any) -> Any:
    """The client of `key` (its configuration and this process: a client is not carried
    across a fork), made once."""
    key = (*key, str(os.getpid()))
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = make()
    return client


# -- GCS: objects.rewrite, looped on its token -------------------------------------------


def _gcs_client() -> Any:
    try:  # (by its full name: `from google.cloud import` would find a module blocked)
        import google.cloud.storage as storage
    except ImportError:
        raise _missing_library("gs") from None
    host = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if host and "://" not in host:
        host = "http://" + host

    def make() -> Any:
        if not host:  # application-default credentials, found by the library
            return storage.Client(project=None)
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(
            project=None,
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": host},
        )

    credentials = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", "")
    return _cached(("gs", host, credentials), make)


def _gcs_retry() -> Any:
    from google.cloud.storage.retry import DEFAULT_RETRY

    retry = DEFAULT_RETRY.with_delay(initial=1.0, maximum=8.0, multiplier=2.0)
    return retry.with_deadline(_GCS_RETRY_S)


def _gcs_copy(bucket_name: str, source_key: str, target_key: str, source: str, target: str):
    try:
        bounds: dict[str, Any] = {"timeout": (_CONNECT_S, _READ_S), "retry": _gcs_retry()}
        bucket = _gcs_client().bucket(bucket_name)
        origin, copied = bucket.blob(source_key), bucket.blob(target_key)
        if copied.exists(**bounds):
            raise FileExistsError(f"{target} exists already")
        token = None
        while True:  # each call copies a part (a large object, another location or class)
            token, _, _ = copied.rewrite(origin, token=token, if_generation_match=0, **bounds)
            if token is None:
                return
    except (FileExistsError, ConfigError):
        raise
    except Exception as e:
        raise _gcs_error(e, source, target) from None


def _gcs_error(e: Exception, source: str, target: str) -> Exception:
    """What the GCS client's `e` means: a missing source, a target there, else a
    `StorageError` (a 404 is the bucket's when GCS says so)."""
    from google.api_core import exceptions

    if isinstance(e, exceptions.NotFound):
        if "bucket does not exist" not in str(e.message).lower():
            return FileNotFoundError(f"{source} does not exist")
    if isinstance(e, exceptions.PreconditionFailed):
        return FileExistsError(f"{target} was created by another writer meanwhile")
    return _failed(source, target, e)


# -- S3: CopyObject, or UploadPartCopy past 5 GiB ----------------------------------------


def _s3_client() -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise _missing_library("s3") from None
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if not region and endpoint:
        region = "us-east-1"  # an S3-compatible server: no region to look up (as `_remote`)
    profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or ""
    # Which credentials: a changed key pair in the environment is another client.
    keys = "\n".join(
        os.environ.get(name, "")
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
    )
    config = Config(
        connect_timeout=_CONNECT_S,
        read_timeout=_READ_S,
        retries={"max_attempts": _S3_ATTEMPTS, "mode": "standard"},
        max_pool_connections=_POOL,
    )

    def make() -> Any:
        session = boto3.Session()  # a session per client: sessions are not shared
        client = session.client("s3", endpoint_url=endpoint, region_name=region, config=config)
        for operation in ("CopyObject", "CompleteMultipartUpload"):
            client.meta.events.register(f"before-sign.s3.{operation}", _create_only)
        return client

    return _cached(("s3", endpoint or "", region or "", profile, str(hash(keys))), make)
    # (a hash: no key is kept here in the clear)


def _create_only(request: Any, **_: Any) -> None:
    """S3's create-only precondition on the copy's target (`If-None-Match: *`), set on
    the request whatever botocore's version models (it signs it as any header)."""
    request.headers["If-None-Match"] = "*"


def _s3_copy(bucket: str, source_key: str, target_key: str, source: str, target: str):
    try:
        client = _s3_client()
        head = _s3_head(client, bucket, source_key)
        if head is None:
            raise FileNotFoundError(f"{source} does not exist")
        if _s3_head(client, bucket, target_key) is not None:
            raise FileExistsError(f"{target} exists already")
        origin = {"Bucket": bucket, "Key": source_key}
        if head["ContentLength"] <= COPY_MAX_BYTES:
            client.copy_object(Bucket=bucket, Key=target_key, CopySource=origin)
        else:
            _s3_copy_parts(client, bucket, target_key, origin, head)
    except (FileNotFoundError, FileExistsError, ConfigError):
        raise
    except Exception as e:
        raise _s3_error(e, source, target) from None


def _s3_error(e: Exception, source: str, target: str) -> Exception:
    """What boto3's `e` means: a missing source, a target there, else a `StorageError`."""
    response = getattr(e, "response", None)  # botocore's ClientError: the server's answer
    code = str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""
    if code in ("NoSuchKey", "404"):
        return FileNotFoundError(f"{source} does not exist")
    if code in ("PreconditionFailed", "412"):
        return FileExistsError(f"{target} was created by another writer meanwhile")
    return _failed(source, target, e)


def _s3_head(client: Any, bucket: str, key: str) -> dict[str, Any] | None:
    """The object's HEAD answer, None when it does not exist."""
    from botocore.exceptions import ClientError

    try:
        return client.head_object(Bucket=bucket, Key=key)
    except ClientError as e:
        if str(e.response.get("Error", {}).get("Code", "")) in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def _s3_copy_parts(
    client: Any, bucket: str, key: str, origin: dict[str, str], head: dict[str, Any]
) -> None:
    """An object past `COPY_MAX_BYTES` copied part by part (`UploadPartCopy`), every
    part of the source's version seen by `head` (its ETag), then completed create-only;
    the upload is aborted on any failure (no part is left billed)."""
    size = head["ContentLength"]
    part = max(PART_BYTES, -(-size // _MAX_PARTS))
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    try:
        parts = []
        for number, start in enumerate(range(0, size, part), start=1):
            answer = client.upload_part_copy(
                Bucket=bucket,
                Key=key,
                UploadId=upload,
                PartNumber=number,
                CopySource=origin,
                CopySourceRange=f"bytes={start}-{min(start + part, size) - 1}",
                CopySourceIfMatch=head["ETag"],
            )
            parts.append({"PartNumber": number, "ETag": answer["CopyPartResult"]["ETag"]})
        client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
        )
    except BaseException:
        try:
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
        except Exception:
            pass  # the failure raised below says what went wrong
        raise
