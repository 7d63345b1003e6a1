"""Strict settings for every test: several CPU devices, rank promotion raises,
our own warnings are errors, upstream ones shown (see pyproject.toml)."""

import os
import subprocess
import tempfile

# Must be set before jax initialises its backends.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

import jax_cb_ckpt  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def ckpt_dir(tmp_path):
    return tmp_path / "ckpt"


@pytest.fixture
def make_ckpt(ckpt_dir):
    """Checkpointers that are closed at the end of the test, whatever happens."""
    made = []

    def make(directory=None, **kwargs):
        ckpt = jax_cb_ckpt.Checkpointer(directory or ckpt_dir, **kwargs)
        made.append(ckpt)
        return ckpt

    yield make
    for ckpt in made:
        try:
            ckpt.close()
        except jax_cb_ckpt.CheckpointError:
            pass


@pytest.fixture
def small_disk():
    """`small_disk("512k")`: a directory on a tmpfs of that size (a disk that fills up).
    Mounting needs root, as in CI here; elsewhere the test is skipped, saying why."""
    mounts = []

    def make(size):
        path = tempfile.mkdtemp()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True
        )
        if result.returncode != 0:
            os.rmdir(path)
            pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.decode().strip()}")
        mounts.append(path)
        return path

    yield make
    for path in mounts:
        subprocess.run(["umount", "-l", path], check=False)
        os.rmdir(path)


# -- object storage: real local servers (tests/storage_servers.py) ------------------------


@pytest.fixture(scope="session")
def s3_server():
    from storage_servers import S3Server

    server = S3Server()
    yield server
    server.close()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    from storage_servers import GCSServer

    server = GCSServer(str(tmp_path_factory.mktemp("gcs")))
    yield server
    server.close()


@pytest.fixture(scope="session")
def gcs_emulator():
    from storage_servers import GCSEmulator

    server = GCSEmulator()
    yield server
    server.close()


# `remote`'s servers: its default params, and "gcp-storage-emulator" by indirect
# parametrization (the storage basics run against it too).
_SERVERS = {"gs": "gcs_server", "s3": "s3_server", "gcp-storage-emulator": "gcs_emulator"}


class Remote:
    """A fresh prefix in a bucket of a local server, its environment set for the test."""

    def __init__(self, scheme, server, bucket, prefix):
        self.scheme = scheme
        self.server = server
        self.bucket = bucket
        self.url = f"{scheme}://{bucket}/{prefix}"
        self.env = server.env()


@pytest.fixture(params=["gs", "s3"])
def remote(request, remote_on):
    """`remote.url`: gs://... or s3://... on a local server (one test per scheme; a test
    parametrized indirectly with "gcp-storage-emulator" also runs on that server)."""
    return remote_on(request.param)


@pytest.fixture
def remote_on(request, monkeypatch):
    """`remote_on(server)`: a fresh prefix in a new bucket of the local server `server`
    ("gs", "s3" or "gcp-storage-emulator"), its environment set for the test."""
    from storage_servers import unique

    def make(name):
        server = request.getfixturevalue(_SERVERS[name])
        bucket = "bucket-" + unique("t")[2:]
        server.make_bucket(bucket)
        made = Remote("s3" if name == "s3" else "gs", server, bucket, unique())
        for key, value in made.env.items():
            monkeypatch.setenv(key, value)
        # Set by the library from STORAGE_EMULATOR_HOST: gone again after the test.
        for key in ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING"):
            monkeypatch.delenv(key, raising=False)
        return made

    return make


@pytest.fixture(params=["local", "gs", "s3"])
def where(request, tmp_path, remote_on):
    """A location of each kind (the storage tests run on all three): a directory, or a
    prefix on a local GCS or S3 server."""
    if request.param == "local":
        path = str(tmp_path / "ckpt")
        os.makedirs(path)
        return path
    return remote_on(request.param).url
