"""A test backend that reports what it received: ``python -m tests.integration.echo_backend --port P``.

Every request gets JSON ``{served_by, destination_header, method, path, body_bytes, body_sha256}`` so a test
can assert, at the backend, which endpoint served a request and what the proxy forwarded.
"""

import argparse
import hashlib

from aiohttp import web


def make_app(address: str) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({
            "served_by": address,
            "destination_header": request.headers.get("x-gateway-destination-endpoint"),
            "method": request.method,
            "path": request.path_qs,
            "body_bytes": len(body),
            "body_sha256": hashlib.sha256(body).hexdigest(),
        })

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/health", health)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    web.run_app(make_app(f"{args.host}:{args.port}"), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
