"""A TCP forwarder: `python tcp_proxy.py LISTEN_PORT TARGET_PORT` (both on 127.0.0.1).

Killing it is, to a client, the server going away (connections reset, then refused);
starting it again on the same port is the server coming back with its data. With
TARGET_PORT `hang` it accepts connections and never answers (a server that hangs).

`python tcp_proxy.py LISTEN_PORT TARGET_PORT flaky:N LOG` is a flaky HTTP server: it
reads each request (head and body: HTTP/1.1 without pipelining, so a request starts
once the previous response is out), and of every N requests one gets a transient fault
instead of the server, in turn an HTTP 503, an HTTP 429 and a reset connection (RST);
after a fault the connection is closed. Each fault is a line in the file LOG.

`python tcp_proxy.py LISTEN_PORT TARGET_PORT deny:TEXT LOG` denies, as a server does a
request signed with a wrong secret, every request whose request line holds TEXT (every
request when TEXT is empty), and forwards the others: an HTTP 403 whose body echoes
the credentials the request carried, as real S3 does (its `SignatureDoesNotMatch`
error names the `<AWSAccessKeyId>` and repeats the string to sign, the signature and
the canonical request), with a signed URL in the message; to a GCS request (a bearer
token) a JSON error that repeats the token. Each denied request line is a line in LOG.

`python tcp_proxy.py LISTEN_PORT TARGET_PORT count: LOG` forwards as the first form and
keeps in the file LOG the bytes it moved so far, "<to the server> <back to the client>"
(rewritten after each block): what a client sent and received, whatever its protocol.
"""

import asyncio
import itertools
import os
import re
import socket
import struct
import sys
from xml.sax.saxutils import escape

KINDS = ("503 Service Unavailable", "429 Too Many Requests", "reset")


async def _pipe(reader, writer, count=None):
    try:
        while data := await reader.read(1 << 16):
            if count is not None:  # (counted before the other end can see it)
                count(len(data))
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def _request(reader):
    """One whole request as bytes, or b"" when the client closed the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b""
    fields = {}
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    if fields.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            body += size_line + await reader.readexactly(size + 2)
            if size == 0:
                return head + body
    return head + await reader.readexactly(int(fields.get("content-length", 0)))


async def _fault(kind, writer, log):
    with open(log, "a") as f:
        f.write(kind.split()[0] + "\n")
    if kind == "reset":
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    else:
        body = b"<Error><Code>SlowDown</Code><Message>try again</Message></Error>"
        head = f"HTTP/1.1 {kind}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        writer.write(head.encode() + body)
        await writer.drain()
    writer.close()


def _authorization(request):
    head = request.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    for field in head.split("\r\n")[1:]:
        name, _, value = field.partition(":")
        if name.strip().lower() == "authorization":
            return value.strip()
    return ""


def _denial(request):
    """The 403 a server that checks signatures gives `request`, echoing its secrets."""
    line = request.split(b"\r\n", 1)[0].decode("latin-1")
    auth = _authorization(request)
    path = line.split(" ")[1] if " " in line else "/"
    bearer = re.match(r"Bearer\s+(\S+)", auth)
    if bearer:  # GCS
        token = bearer.group(1)
        signed = f"https://storage.googleapis.com{path}?GoogleAccessId=sa&Signature={token}"
        body = (
            '{"error": {"code": 403, "message": "Permission denied: access_token='
            + token
            + " for "
            + signed
            + '", "errors": [{"reason": "forbidden", "message": "Authorization: Bearer '
            + token
            + '"}], "access_token": "'
            + token
            + '"}}'
        ).encode()
        kind = "application/json"
    else:  # S3: AWS4-HMAC-SHA256 Credential=<key id>/<date>/<region>/s3/aws4_request, ...
        # (well-formed XML, as S3's: an XML parser reads it, as a regex does)
        found = re.search(r"Credential=([^/,\s]+)/([^,\s]*)", auth)
        key_id, scope = found.groups() if found else ("none", "")
        found = re.search(r"Signature=([0-9a-f]+)", auth)
        signature = found.group(1) if found else ""
        signed = (
            f"https://bucket.s3.amazonaws.com{path}?X-Amz-Algorithm=AWS4-HMAC-SHA256"
            f"&X-Amz-Credential={key_id}%2F{scope}&X-Amz-Signature={signature}"
        )
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SignatureDoesNotMatch'
            "</Code><Message>The request signature we calculated does not match the "
            f"signature you provided. Check your key and signing method. ({escape(signed)})"
            f"</Message><AWSAccessKeyId>{key_id}</AWSAccessKeyId><StringToSign>"
            f"AWS4-HMAC-SHA256\n20261202T000000Z\n{scope}\n0f0f</StringToSign>"
            f"<SignatureProvided>{signature}</SignatureProvided><StringToSignBytes>41 57"
            f"</StringToSignBytes><CanonicalRequest>{escape(line)}\nauthorization:{auth}"
            "</CanonicalRequest><RequestId>4442587FB7D0A2F9</RequestId></Error>"
        ).encode()
        kind = "application/xml"
    return (
        f"HTTP/1.1 403 Forbidden\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}"
        "\r\nConnection: close\r\n\r\n"
    ).encode() + body


async def main(listen, target, log=None, period=0, deny=None, counting=False):
    faults = itertools.cycle([x for kind in KINDS for x in [kind] + [None] * (period - 1)])

    async def hang(client_reader, client_writer):
        await client_reader.read()  # until the client gives up

    async def connect(client_writer):
        try:
            return await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            client_writer.close()
            return None, None

    moved = [0, 0]  # to the server, back to the client (count mode)

    def counter(direction):
        if not counting:
            return None

        def count(n):
            moved[direction] += n
            with open(f"{log}.part", "w") as f:  # (replaced whole: never read half-written)
                f.write(f"{moved[0]} {moved[1]}\n")
            os.replace(f"{log}.part", log)

        return count

    async def forward(client_reader, client_writer):
        server_reader, server_writer = await connect(client_writer)
        if server_writer is not None:
            await asyncio.gather(
                _pipe(client_reader, server_writer, counter(0)),
                _pipe(server_reader, client_writer, counter(1)),
            )

    async def flaky(client_reader, client_writer):
        server_reader, server_writer = await connect(client_writer)
        if server_writer is None:
            return
        back = asyncio.ensure_future(_pipe(server_reader, client_writer))
        try:
            while request := await _request(client_reader):
                line = request.split(b"\r\n", 1)[0].decode("latin-1")
                if deny is not None and deny in line:
                    with open(log, "a") as f:  # what was denied, and with what credential
                        f.write(f"{line}\t{_authorization(request)}\n")
                    client_writer.write(_denial(request))
                    await client_writer.drain()
                    client_writer.close()
                    break
                fault = next(faults) if period else None
                if fault:
                    await _fault(fault, client_writer, log)
                    break
                server_writer.write(request)
                await server_writer.drain()
        except (
            ConnectionError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ValueError,
        ):
            client_writer.close()  # a request this proxy cannot read: the client sees a reset
        finally:
            server_writer.close()
            back.cancel()

    serve = hang if target == "hang" else forward if counting or not log else flaky
    server = await asyncio.start_server(serve, "127.0.0.1", listen, reuse_address=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    target = sys.argv[2]
    mode, _, arg = sys.argv[3].partition(":") if len(sys.argv) > 3 else ("", "", "")
    log = sys.argv[4] if mode else None
    period = int(arg) if mode == "flaky" else 0
    deny = arg if mode == "deny" else None
    port = target if target == "hang" else int(target)
    asyncio.run(main(int(sys.argv[1]), port, log, period, deny, counting=mode == "count"))
