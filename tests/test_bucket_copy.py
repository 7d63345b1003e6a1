"""A link in a bucket (`BucketChunks.link`) is a server-side copy (`_storage/_copy.py`):
GCS's rewrite and S3's CopyObject, against the local servers of conftest.py
(fake-gcs-server, moto). That the bytes never pass through this process is measured
by a TCP proxy between it and the server that counts the bytes moved each way
(tests/tcp_proxy.py's count mode)."""

import os
import sys
import threading
import time

import pytest

from jax_cb_ckpt import ConfigError
from jax_cb_ckpt._storage import _copy, _remote
from jax_cb_ckpt._storage._bucket import BucketChunks
from jax_cb_ckpt._storage._faults import StorageError

MIB = 1 << 20


def _through_proxy(remote, monkeypatch, tmp_path, **mode):
    """A proxy in front of `remote`'s server, the environment pointed at it."""
    from storage_servers import Proxy

    proxy = Proxy(remote.server.origin_port, **mode)
    for name, value in remote.server.env(proxy.port).items():
        monkeypatch.setenv(name, value)
    return proxy


def _moved(log):
    """(bytes to the server, bytes back to the client) through a counting proxy."""
    if not log.exists():
        return 0, 0
    up, down = log.read_text().split()
    return int(up), int(down)


def test_a_link_in_a_bucket_is_a_server_side_copy(remote, monkeypatch, tmp_path):
    """A 32 MiB object linked through a proxy that counts the bytes: less than 1 MiB
    moves either way (a copy through this process moves 32 MiB each way), and the
    target holds the source's bytes, the source intact."""
    chunks = BucketChunks(remote.url)
    data = os.urandom(32 * MIB)
    chunks.put("1/state/d/data", data)
    log = tmp_path / "moved"
    proxy = _through_proxy(remote, monkeypatch, tmp_path, count=log)
    try:
        chunks.link("1/state/d/data", "2/state/d/data")
        up, down = _moved(log)
    finally:
        proxy.kill()
    assert 0 < up < MIB and 0 < down < MIB, (up, down)
    for name, value in remote.env.items():  # straight to the server again
        monkeypatch.setenv(name, value)
    assert chunks.get("2/state/d/data", 64 * MIB) == data
    assert chunks.get("1/state/d/data", 64 * MIB) == data


def test_a_link_of_a_missing_source_is_file_not_found(remote):
    chunks = BucketChunks(remote.url)
    with pytest.raises(FileNotFoundError, match="1/none"):
        chunks.link("1/none", "2/none")
    assert chunks.get("2/none", 10) is None


def test_a_link_onto_an_existing_target_is_refused_and_leaves_it(remote):
    """Created only if absent: a target already there is not overwritten."""
    chunks = BucketChunks(remote.url)
    chunks.put("1/a", b"source")
    chunks.put("2/a", b"already there")
    with pytest.raises(FileExistsError, match="2/a"):
        chunks.link("1/a", "2/a")
    assert chunks.get("2/a", 100) == b"already there"
    assert chunks.get("1/a", 100) == b"source"


def test_links_from_many_threads_share_one_client(remote):
    """The caller links a step's files from a thread pool: 32 links from 8 threads at
    once, each target the bytes of its source."""
    chunks = BucketChunks(remote.url)
    sources = {f"1/f{i}": os.urandom(1000 + i) for i in range(32)}
    _remote.write_many({chunks.location(name): data for name, data in sources.items()})
    errors = []

    def link(names):
        try:
            for name in names:
                chunks.link(name, "2" + name[1:])
        except Exception as e:  # (reported below)
            errors.append(e)

    names = sorted(sources)
    threads = [threading.Thread(target=link, args=(names[i::8],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for name, data in sources.items():
        assert chunks.get("2" + name[1:], 10_000) == data


@pytest.mark.parametrize("remote", ["s3"], indirect=True)
def test_an_s3_object_past_one_copy_s_limit_is_copied_part_by_part(remote, monkeypatch, tmp_path):
    """S3 copies at most 5 GiB in one CopyObject: a larger object is copied with
    UploadPartCopy, server-side too. The limit lowered to 8 MiB (parts of 5 MiB, S3's
    smallest) so that moto copies a 32 MiB object in 7 parts."""
    monkeypatch.setattr(_copy, "COPY_MAX_BYTES", 8 * MIB)
    monkeypatch.setattr(_copy, "PART_BYTES", 5 * MIB)
    chunks = BucketChunks(remote.url)
    data = os.urandom(32 * MIB)
    chunks.put("1/big", data)
    log = tmp_path / "moved"
    proxy = _through_proxy(remote, monkeypatch, tmp_path, count=log)
    try:
        chunks.link("1/big", "2/big")
        up, down = _moved(log)
    finally:
        proxy.kill()
    assert up < MIB and down < MIB, (up, down)
    for name, value in remote.env.items():
        monkeypatch.setenv(name, value)
    assert chunks.get("2/big", 64 * MIB) == data
    with pytest.raises(FileExistsError):
        chunks.link("1/big", "2/big")


@pytest.mark.parametrize("scheme, extra", [("gs", "gcs"), ("s3", "s3")])
def test_a_link_without_the_client_library_names_the_extra(scheme, extra, monkeypatch):
    """Without google-cloud-storage (gs://) or boto3 (s3://) installed (an import
    blocked as Python blocks one: None in sys.modules), a link is a ConfigError that
    names the scheme and the install line."""
    for module in ("google.cloud.storage", "boto3"):
        monkeypatch.setitem(sys.modules, module, None)
    chunks = BucketChunks(f"{scheme}://bucket-x/run")
    with pytest.raises(ConfigError) as raised:
        chunks.link("1/a", "2/a")
    message = str(raised.value)
    assert f"{scheme}://" in message and "server-side copy" in message
    assert f"pip install 'jax-cb-ckpt[{extra}]'" in message


@pytest.mark.parametrize("remote", ["s3"], indirect=True)
def test_a_refused_copy_is_a_storage_error_without_the_credentials(remote, monkeypatch, tmp_path):
    """A server that refuses the copy as S3 refuses a wrong secret, its answer echoing
    the key id, the signature and a signed URL: a StorageError that keeps the error's
    code and repeats none of them, nor the secret."""
    chunks = BucketChunks(remote.url)
    chunks.put("1/a", b"source")
    log = tmp_path / "denied"
    proxy = _through_proxy(remote, monkeypatch, tmp_path, deny=(log, "PUT"))
    try:
        with pytest.raises(StorageError) as raised:
            chunks.link("1/a", "2/a")
    finally:
        proxy.kill()
    message = str(raised.value)
    assert "SignatureDoesNotMatch" in message and "1/a" in message
    assert "X-Amz-Credential=(removed)" in message  # the echo was there, and went
    assert log.read_text().count("PUT") >= 1  # the copy was sent, and denied
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert remote.env[name] not in message
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_link_against_a_dead_server_fails_within_the_bound(remote, monkeypatch, tmp_path, how):
    """The server gone (a proxy in front of it killed: connections refused) or hung
    (connections accepted, never answered): a StorageError within 60 s, as every
    operation of `_remote` (docs/storage.md, "Faults")."""
    chunks = BucketChunks(remote.url)
    chunks.put("1/a", b"source")
    proxy = _through_proxy(remote, monkeypatch, tmp_path)
    proxy.kill()
    if how == "hung":
        proxy.start(hang=True)
    start = time.monotonic()
    try:
        with pytest.raises(StorageError, match="copying .*1/a"):
            chunks.link("1/a", "2/a")
    finally:
        waited = time.monotonic() - start
        proxy.kill()
    assert waited < 60, waited
