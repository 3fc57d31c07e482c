"""A test backend that reports what it received: ``python -m tests.integration.echo_backend --port P``.

Every request gets JSON ``{served_by, destination_header, method, path, body_bytes, body_sha256, content_length,
priority}`` so a test can assert, at the backend, which endpoint served a request and what the proxy forwarded
(``priority``: the body's ``priority`` field when it is a JSON object that has one, else null).
"""

import argparse
import hashlib
import json
import ssl

from aiohttp import web


def make_app(address: str) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        return web.json_response({
            "content_length": request.headers.get("content-length"),
            "priority": parsed.get("priority") if isinstance(parsed, dict) else None,
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
    parser.add_argument("--tls-cert", help="PEM certificate chain: serve HTTPS (with --tls-key)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    args = parser.parse_args()
    context = None
    if args.tls_cert:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(args.tls_cert, args.tls_key)
    web.run_app(make_app(f"{args.host}:{args.port}"), host=args.host, port=args.port, print=None,
                ssl_context=context)


if __name__ == "__main__":
    main()
