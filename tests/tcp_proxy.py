"""A TCP forwarder: `python tcp_proxy.py LISTEN_PORT TARGET_PORT` (both on 127.0.0.1).

Killing it is, to a client, the server going away (connections reset, then refused);
starting it again on the same port is the server coming back with its data. With
TARGET_PORT `hang` it accepts connections and never answers (a server that hangs).
"""

import asyncio
import sys


async def _pipe(reader, writer):
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def main(listen, target):
    async def hang(client_reader, client_writer):
        await client_reader.read()  # until the client gives up

    async def handle(client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(
            _pipe(client_reader, server_writer), _pipe(server_reader, client_writer)
        )

    serve = hang if target == "hang" else handle
    server = await asyncio.start_server(serve, "127.0.0.1", listen, reuse_address=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    target = sys.argv[2]
    asyncio.run(main(int(sys.argv[1]), target if target == "hang" else int(target)))
