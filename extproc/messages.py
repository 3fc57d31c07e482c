"""Builders of ext_proc ``ProcessingResponse`` messages; the only module that writes Envoy's wire format.

Source: envoy/service/ext_proc/v3/external_processor.proto (Envoy 1.40, via xds-protos). Header values are
set through ``raw_value`` only: Envoy answers 500 when both ``value`` and ``raw_value`` are set.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from astrolabe.openai_errors import IMMEDIATE_RESPONSE_DETAILS_PREFIX
from extproc import wire
from extproc.errors import RoutingError

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _set_header(key: str, value: bytes) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value), append_action=_OVERWRITE
    )


def destination_common(destination: str, extra_headers: Sequence[tuple[str, bytes]] = (),
                       body: bytes | None = None) -> pb.CommonResponse:
    """Header mutation that sets the destination header (overwriting a client's) and re-evaluates the route.

    Args:
        destination: ``ip:port[,ip:port...]``.
        extra_headers: more request headers to set (overwriting), e.g. ``traceparent`` and ``tracestate``.
        body: a BUFFERED-mode answer's new request body (None: the body goes on unchanged); its
            ``content-length`` comes in ``extra_headers``.
    """
    headers = [_set_header(wire.DESTINATION_HEADER, destination.encode())]
    headers += [_set_header(key, value) for key, value in extra_headers]
    return pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=headers), clear_route_cache=True,
                             body_mutation=None if body is None else pb.BodyMutation(body=body))


def destination_metadata(destination: str) -> struct_pb2.Struct:
    """Dynamic metadata ``{"envoy.lb": {"x-gateway-destination-endpoint": destination}}``."""
    metadata = struct_pb2.Struct()
    metadata.get_or_create_struct(wire.LB_METADATA_NAMESPACE)[wire.DESTINATION_HEADER] = destination
    return metadata


def headers_continue() -> pb.ProcessingResponse:
    """Request-headers answer that changes nothing (the route is set later, on the body)."""
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse())


def headers_route(destination: str, extra_headers: Sequence[tuple[str, bytes]] = ()) -> pb.ProcessingResponse:
    """Request-headers answer that routes to ``destination`` (``ip:port[,ip:port...]``), also setting
    ``extra_headers`` (a ``content-length`` for a body re-sent changed)."""
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=destination_common(destination, extra_headers)),
        dynamic_metadata=destination_metadata(destination),
    )


def body_route(destination: str, extra_headers: Sequence[tuple[str, bytes]] = (),
               body: bytes | None = None) -> pb.ProcessingResponse:
    """BUFFERED-mode request-body answer that routes to ``destination`` (header mutation allowed there), also
    setting ``extra_headers`` (a ``content-length`` for a changed body), and replaces the body with ``body``
    (None: unchanged)."""
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=destination_common(destination, extra_headers, body)),
        dynamic_metadata=destination_metadata(destination),
    )


def streamed_body(body: bytes, *, end_of_stream: bool) -> Iterator[pb.ProcessingResponse]:
    """FULL_DUPLEX_STREAMED re-send of the request body, in chunks of at most ``MAX_STREAMED_CHUNK_BYTES``.

    An empty body yields one empty chunk so that Envoy still sees ``end_of_stream``.
    """
    size = wire.MAX_STREAMED_CHUNK_BYTES
    offsets = range(0, max(len(body), 1), size)
    for offset in offsets:
        last = offset + size >= len(body)
        chunk = pb.StreamedBodyResponse(body=body[offset:offset + size], end_of_stream=end_of_stream and last)
        yield pb.ProcessingResponse(
            request_body=pb.BodyResponse(
                response=pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=chunk))
            )
        )


def streamed_response_body_echo(body: pb.HttpBody) -> pb.ProcessingResponse:
    """FULL_DUPLEX_STREAMED answer to a response-body chunk that sends it on unchanged (with its end of stream).

    In that mode Envoy forwards to the client only the body the processor streams back, so acknowledging a chunk
    without it loses the response (Envoy answers 503, or 200 with an empty body; seen with Envoy 1.40).
    """
    chunk = pb.StreamedBodyResponse(body=body.body, end_of_stream=body.end_of_stream)
    return pb.ProcessingResponse(
        response_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=chunk))))


def trailers_continue() -> pb.ProcessingResponse:
    """Request-trailers answer that changes nothing."""
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())


def immediate_error(error: RoutingError) -> pb.ProcessingResponse:
    """Answers the client directly with ``error``'s HTTP status and OpenAI-style JSON body."""
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.http_status),
            headers=pb.HeaderMutation(set_headers=[_set_header("content-type", wire.CONTENT_TYPE_JSON),
                                                   *(_set_header(name, value.encode("latin-1"))
                                                     for name, value in error.headers)]),
            body=error.json_body(),
            details=f"{IMMEDIATE_RESPONSE_DETAILS_PREFIX}{error.code.value}",
        )
    )
