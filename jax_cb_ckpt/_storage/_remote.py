"""Object storage: a checkpoint directory that is a prefix in a GCS or S3 bucket.

`gs://bucket/run1` and `s3://bucket/run1` name a prefix in a bucket. Every object is read
and written with TensorStore's key-value stores (`gcs`, `s3`: the same engine that writes
the arrays, `_store.py`), so object storage needs no client library of its own (but
for a server-side copy, which TensorStore does not send: `_copy`, with the provider's
library, from the same environment), and configuration is the standard environment
only:

- Google Cloud Storage: application-default credentials (`GOOGLE_APPLICATION_CREDENTIALS`,
  `gcloud auth application-default login`, the metadata server). `STORAGE_EMULATOR_HOST`
  points at an emulator (as Google's own clients read it; TensorStore's name for it,
  `TENSORSTORE_GCS_HTTP_URL`, is set from it), and an emulator needs no credentials.
- S3: `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` (an S3-compatible server), `AWS_REGION`
  or `AWS_DEFAULT_REGION`, and AWS's usual credential chain (the `AWS_ACCESS_KEY_ID`
  variables, `AWS_PROFILE` and the shared files, the instance metadata service).
- Both: a stalled request is given up after `TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS`
  (set to 6 at import unless set), a failed one retried 4 times (`_RETRIES`).

Credentials never pass through this module: specs name a credential *source*, never a
key. A server's answer may still echo one (S3's 403 for a wrong secret names the key id
and repeats what was signed), so every text of TensorStore's that goes into an error is
scrubbed first (`_faults.scrub`). A URL with user information (`s3://key:secret@bucket`) is
refused without repeating it.

Object stores have no rename, no directories and no locks; what replaces them (a commit
marker written last, a lock object written under a precondition) is `_format`'s and
`_lock`'s. Here: URLs, specs, and five operations (read, write, list, delete, a prefix
delete), each bounded: TensorStore retries transient errors (429, 5xx, a reset
connection) with backoff, `_RETRIES`, and then fails with `StorageError`.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from typing import TYPE_CHECKING, Any

from .._base._errors import ConfigError, where
from ._faults import StorageError, scrub

if TYPE_CHECKING:
    import tensorstore


class _OnFirstUse:
    """TensorStore, imported when first used: listing a local directory (the command
    line's `ls`) never needs it, and it costs 0.3-0.9 s to import (ml_dtypes)."""

    def __getattr__(self, name: str) -> Any:
        import tensorstore

        return getattr(tensorstore, name)


ts: Any = _OnFirstUse()


SCHEMES = ("gs", "s3")  # what Checkpointer(directory=...) accepts besides local paths
_DRIVERS = {"gs": "gcs", "s3": "s3"}
# TensorStore's generation of "no object": a write with this precondition creates the
# object only if it does not exist (GCS `ifGenerationMatch=0`, S3 `If-None-Match: *`).
ABSENT = b"\x02"
# TensorStore's "unknown" generation: a write with it as precondition is unconditional.
UNKNOWN = b""

# Transient errors are retried with exponential backoff, 1 s doubling to 8 s, four
# times (TensorStore's default, 32 times up to 32 s each, waits ~15 minutes for a server
# that is down). A request that transfers less than 256 bytes/s for _STALLED_S seconds
# is given up as well (a server that accepts a connection and never answers would
# otherwise hang it forever: TensorStore sets no request timeout of its own). So an
# operation fails within 5 x 6 + 15 = 45 s (docs/storage.md: "at most 60 s").
_RETRIES = {"max_retries": 4, "initial_delay": "1s", "max_delay": "8s"}
_STALLED_S = 6
# Read by TensorStore once, at its first HTTP request in the process: set at import,
# unless the user chose a value.
os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", str(_STALLED_S))

_URL = re.compile(r"([a-z0-9][a-z0-9+.-]*)://([^/]*)(/.*)?", re.ASCII | re.IGNORECASE)
# Bucket names both providers accept: 3-63 of lowercase letters, digits, '-', '_', '.'.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]", re.ASCII)


def is_url(path: str) -> bool:
    """`path` is an object-storage URL this library handles (as `canonical` made it)."""
    return path.startswith(("gs://", "s3://"))


def canonical(text: str) -> str:
    """`gs://bucket/prefix` or `s3://bucket/prefix`, without a trailing slash, or a
    `ConfigError` naming what is wrong with the URL."""
    match = _URL.fullmatch(text)
    if match is None:
        raise ConfigError(f"{where()}: directory {text!r} is not a URL this library can read.")
    scheme, bucket, rest = match.group(1).lower(), match.group(2), match.group(3) or ""
    if scheme not in SCHEMES:
        hint = " (Google Cloud Storage is gs://)" if scheme in ("gcs", "google") else ""
        raise ConfigError(
            f"{where()}: directory {text!r} uses the {scheme}:// scheme{hint}; jax_cb_ckpt "
            "writes local directories, gs://bucket/path (Google Cloud Storage) and "
            "s3://bucket/path (S3 and S3-compatible servers). Fix: use one of those, or "
            "a path where the storage is mounted (e.g. with FUSE)."
        )
    if "@" in bucket:  # never repeat it: it may hold a secret
        raise ConfigError(
            f"{where()}: the {scheme}:// URL holds user information before '@' (not "
            "repeated here, it may be a secret). Credentials are never part of a URL: "
            "they come from the environment (docs/storage.md). Fix: remove it."
        )
    if not _BUCKET.fullmatch(bucket):
        raise ConfigError(
            f"{where()}: directory {text!r}: {bucket!r} is not a valid bucket name (3 to 63 "
            "lowercase letters, digits, '-', '_' or '.'). Fix: write "
            f"{scheme}://<bucket>/<path>."
        )
    parts = [p for p in rest.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ConfigError(
            f"{where()}: directory {text!r} has '.' or '..' in its path; object names are "
            "taken literally. Fix: write the path without them."
        )
    return f"{scheme}://{bucket}" + "".join("/" + p for p in parts)


def split(url: str) -> tuple[str, str, str]:
    """(scheme, bucket, key) of a canonical URL or a path under one."""
    scheme, rest = url.split("://", 1)
    bucket, _, key = rest.partition("/")
    return scheme, bucket, key


def kvstore_spec(url: str) -> dict[str, Any]:
    """The TensorStore key-value store of the prefix `url/` (a spec, no secrets)."""
    scheme, bucket, key = split(url)
    path = key.rstrip("/") + "/" if key else ""
    spec: dict[str, Any] = {"driver": _DRIVERS[scheme], "bucket": bucket, "path": path}
    if scheme == "gs":
        _emulator_environment()
        spec["gcs_request_retries"] = dict(_RETRIES)
    else:
        spec["s3_request_retries"] = dict(_RETRIES)
        # "default" also reads the shared files and the instance metadata; with the key
        # in the environment, "environment" skips them (and their error lines). Given no
        # profile name, TensorStore's default chain loads no profile at all (0.1.84 to
        # 0.1.86: "could not load a profile", then unsigned requests), so it is named
        # as the AWS tools name it.
        if os.environ.get("AWS_ACCESS_KEY_ID"):
            spec["aws_credentials"] = {"type": "environment"}
        else:
            profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE")
            spec["aws_credentials"] = {"type": "default", "profile": profile or "default"}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            spec["endpoint"] = endpoint
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            spec["aws_region"] = region
        elif endpoint:  # an S3-compatible server: no region to look up
            spec["aws_region"] = "us-east-1"
    return spec


def _emulator_environment() -> None:
    """Google's clients find a GCS emulator through `STORAGE_EMULATOR_HOST`; TensorStore
    reads `TENSORSTORE_GCS_HTTP_URL` (when a store opens): set from the standard one,
    which decides whenever it is set (a value inherited from a parent process that
    used another emulator must not win). An emulator checks no credentials: a fixed
    token spares TensorStore a search for application-default credentials (an error
    line on stderr when there are none)."""
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if not host:
        return
    if "://" not in host:
        host = "http://" + host
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = host
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")


_STORES: dict[str, tensorstore.KvStore] = {}
_STORES_LOCK = threading.Lock()


def _bucket_store(url: str) -> tuple[tensorstore.KvStore, str]:
    """(the bucket's KvStore, the key of `url` in it). Opened once per bucket and
    environment (a test may point one process at several servers)."""
    scheme, bucket, key = split(url)
    spec = kvstore_spec(f"{scheme}://{bucket}")
    # TensorStore reads the GCS endpoint from the environment when a store opens.
    name = json.dumps([spec, os.environ.get("TENSORSTORE_GCS_HTTP_URL")], sort_keys=True)
    with _STORES_LOCK:
        store = _STORES.get(name)
        if store is None:
            store = _STORES[name] = ts.KvStore.open(spec, context=_context()).result()
    return store, key


@functools.cache
def _context() -> tensorstore.Context:
    return ts.Context()


def _failed(what: str, url: str, e: Exception) -> StorageError:
    """The `StorageError` of an operation TensorStore failed with `e`, its text
    scrubbed (`scrub`). Raised `from None`: `e` itself holds what the server said."""
    text = scrub(str(e))
    # A write is refused with 404 only when its bucket is missing.
    if _is_missing_bucket(text) or (what == "writing" and "NOT_FOUND" in text):
        scheme, bucket, _ = split(url)
        return StorageError(
            f"the bucket {scheme}://{bucket} does not exist or is not visible with these "
            f"credentials ({what} {url})"
        )
    return StorageError(f"{what} {url} failed: {text}")


def _is_missing_bucket(text: str) -> bool:
    return (
        "NoSuchBucket" in text
        or ("bucket" in text.lower() and "not found" in text.lower())
        # tensorstore < 0.1.86 reads S3's NoSuchBucket answer to a listing as this
        or "missing <ListBucketResult>" in text
    )


def read(url: str) -> tuple[bytes | None, bytes]:
    """(the object's bytes or None when it does not exist, its generation; `UNKNOWN`
    when the server sent none). The whole object: TensorStore refuses a byte range
    that reaches past an object's end, so "at most n bytes" is no request of its own."""
    return read_many([url])[0]


def read_many(urls: list[str]) -> list[tuple[bytes | None, bytes]]:
    """`read` of each of `urls`, all at once (concurrent requests: one round trip)."""
    return [_read_result(url, future) for url, future in _sent_reads(urls)]


def _sent_reads(
    urls: list[str], ranges: list[slice] | None = None
) -> list[tuple[str, tensorstore.Future[tensorstore.KvStore.ReadResult]]]:
    """(url, its read in flight) for each of `urls` (of `ranges[i]` of it, where given),
    all sent before any is awaited."""
    pending = []
    for i, url in enumerate(urls):
        store, key = _bucket_store(url)
        byte_range = None if ranges is None else ranges[i]
        pending.append((url, store.read(key, byte_range=byte_range)))
    return pending


def read_ranges(ranges: list[tuple[str, int, int]]) -> list[bytes | None]:
    """Bytes [start, stop) of each (url, start, stop), all at once (None for an object
    that does not exist): never more, whatever an object's size. A `StorageError` when
    an object is shorter (servers refuse a range past an object's end)."""
    urls = [url for url, _, _ in ranges]
    sent = _sent_reads(urls, [slice(start, stop) for _, start, stop in ranges])
    return [_read_result(url, future)[0] for url, future in sent]


def list_and_read(url: str, names: list[str]) -> tuple[list[str], list[tuple[bytes | None, bytes]]]:
    """(`list_keys(url)`, `read_many` of `url/name` for each of `names`), the reads and
    the listing sent at once: one round trip where they would be two."""
    pending = _sent_reads([f"{url}/{name}" for name in names])
    keys = list_keys(url)  # sent while the reads are in flight
    return keys, [_read_result(one, future) for one, future in pending]


def _read_result(
    url: str, future: tensorstore.Future[tensorstore.KvStore.ReadResult]
) -> tuple[bytes | None, bytes]:
    try:
        result = future.result()
    except Exception as e:
        raise _failed("reading", url, e) from None
    if result.state != "value":
        return None, ABSENT
    generation = bytes(result.stamp.generation)
    # gcp-storage-emulator sends no generation with an object's bytes (no
    # x-goog-generation): TensorStore then stamps it with GCS generation 0, which no
    # object has, and refuses a write conditioned on it ("Malformed StorageGeneration").
    # Such a generation says nothing: a write after this read cannot be conditioned
    # on it (that server ignores preconditions anyway; the lock reads back each write).
    if generation and not generation.strip(b"\x00"):
        return bytes(result.value), UNKNOWN
    return bytes(result.value), generation


def write(
    url: str, data: bytes, *, if_equal: bytes | None = None, timeout: float | None = None
) -> bytes | None:
    """Write one object; with `if_equal`, only if its generation is that one (`ABSENT`:
    only if it does not exist). Returns the new generation, None when the precondition
    did not hold (nothing written). `timeout`: `TimeoutError` after that many seconds
    (the request goes on in the background)."""
    store, key = _bucket_store(url)
    future = store.write(key, data, if_equal=if_equal)
    try:
        stamp = future.result(timeout=timeout)
    except TimeoutError:
        raise
    except Exception as e:
        raise _failed("writing", url, e) from None
    generation = bytes(stamp.generation)
    return generation or None


def write_many(objects: dict[str, bytes]) -> None:
    """Write several objects at once (concurrent requests), unconditionally."""
    pending = []
    for url, data in objects.items():
        store, key = _bucket_store(url)
        pending.append((url, store.write(key, data)))
    for url, future in pending:
        try:
            future.result()
        except Exception as e:
            raise _failed("writing", url, e) from None


def list_keys(url: str) -> list[str]:
    """Every object under the prefix `url/`, as keys relative to it, sorted."""
    store, key = _bucket_store(url)
    prefix = key.rstrip("/") + "/" if key else ""
    return sorted(k[len(prefix) :] for k in _keys_in(store, prefix, url, "listing"))


def _keys_in(store: tensorstore.KvStore, prefix: str, url: str, what: str) -> list[str]:
    """The keys of `store` that start with `prefix`, filtered here: a server may answer
    a range listing with keys outside the range (gcp-storage-emulator ignores GCS's
    `startOffset`/`endOffset`; S3- and GCS-compatible servers differ), and a key
    outside it taken as inside is another step's object seen as this one's, or worse,
    deleted as this one's."""
    try:
        keys = store.list(ts.KvStore.KeyRange(prefix, _after(prefix))).result()
    except Exception as e:
        raise _failed(what, url, _listing_refusal(store, prefix, e)) from None
    return [k for k in (k.decode() for k in keys) if k.startswith(prefix)]


def _listing_refusal(store: tensorstore.KvStore, prefix: str, e: Exception) -> Exception:
    """The error that says why a listing failed. TensorStore < 0.1.86 reads any S3 error
    answer to a listing (a 403 for a wrong secret as much as a missing bucket's 404) as
    "missing <ListBucketResult>", without the status or the server's message: the same
    request for one object then gets the server's own answer. A read that succeeds (a
    404 on a missing bucket is read as a missing object) leaves `e` as it was."""
    if "missing <ListBucketResult>" not in str(e):
        return e
    try:
        store.read(prefix).result()
    except Exception as refusal:
        return refusal
    return e


def delete(url: str) -> None:
    """Delete one object (nothing if it does not exist)."""
    store, key = _bucket_store(url)
    _delete_keys(store, [key], url)


def delete_prefix(url: str, *, keep: str | None = None) -> None:
    """Delete every object under `url/`, except `url/keep` (deleted last by the caller:
    it marks the rest as ours while they go). Each key is listed (filtered here) and
    deleted by name: TensorStore's `delete_range` deletes what the server lists for the
    range, which on a server that ignores the range is the whole bucket."""
    store, key = _bucket_store(url)
    prefix = key.rstrip("/") + "/"
    keys = _keys_in(store, prefix, url, "deleting")
    _delete_keys(store, [k for k in keys if keep is None or k != prefix + keep], url)


def _delete_keys(store: tensorstore.KvStore, keys: list[str], url: str) -> None:
    """Delete `keys` by name, concurrently (a missing one is no error)."""
    pending = [store.write(k, None) for k in keys]
    try:
        for future in pending:
            future.result()
    except Exception as e:
        raise _failed("deleting", url, e) from None


def _after(prefix: str) -> str:
    """The first key after every key starting with `prefix` ('' means no end)."""
    if not prefix:
        return ""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)
