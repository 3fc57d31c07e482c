"""Metric label values never come from request content (issue 14, security): a client cannot grow the extproc's
/metrics (one series per model name, path or header it sends) or write into it.

Requests with hostile models, paths, headers and served-endpoint reports go through a real extproc over gRPC;
afterwards every label value of every series in its registry is one the configuration or the code defines.
"""

from __future__ import annotations

import json

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc.errors import ErrorCode
from extproc.fleet_state import OUTCOMES as LOCAL_OUTCOMES
from extproc.notices import NOTICE_OUTCOMES
from extproc.predictor_client import OUTCOMES
from extproc.router import FALLBACK_REASONS
from tests.extproc.test_stream import ENDPOINTS, body_msg, headers_msg, running_server

SIDECAR = "127.0.0.1:1"  # nothing listens: every Predict fails, which counts under a known outcome
HOSTILE = '"} 1\nastrolabe_pwned{x="'


def _served(address: str) -> pb.ProcessingRequest:
    """Response headers whose metadata reports ``address`` as the endpoint that served the request."""
    fields = struct_pb2.Struct()
    fields.update({"x-gateway-destination-endpoint-served": address})
    message = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap()))
    message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(fields)
    return message


async def _stream(stub, *messages: pb.ProcessingRequest) -> None:
    call = stub.Process()
    for message in messages:
        await call.write(message)
        await call.read()
    await call.done_writing()
    while await call.read() != grpc.aio.EOF:
        pass


async def test_label_values_are_never_request_content():
    endpoints = [{**e, "predictor": SIDECAR} for e in ENDPOINTS]
    async with running_server({"policy": "astrolabe", "seed": 1, "health_check": {"enabled": False},
                               "output_length": {"source": "fixed"}, "endpoints": endpoints}) as (srv, stub):
        for i in range(20):
            model = f"{HOSTILE}-model-{i}"
            await _stream(stub, headers_msg(path=f"/v1/completions?{HOSTILE}{i}",
                                            extra=[("x-gateway-destination-endpoint", f"10.9.9.{i}:80"),
                                                   ("x-request-id", f"{HOSTILE}{i}")]),
                          body_msg(json.dumps({"model": model, "prompt": "x"}).encode()))  # unknown model: 404
            await _stream(stub, headers_msg(), body_msg(json.dumps({"model": "m", "prompt": HOSTILE,
                                                                    "max_tokens": "x"}).encode()))  # 400
            await _stream(stub, headers_msg(), body_msg(json.dumps({"model": "m", "prompt": "hi"}).encode()),
                          _served(f"10.8.8.{i}:8000"))  # routed; a served endpoint outside the pool is ignored
        allowed = ({e["address"] for e in ENDPOINTS} | {SIDECAR, "astrolabe", "routed", "fallback", "e2e", "ttft",
                                                        "failed"}
                   | {code.value for code in ErrorCode} | set(OUTCOMES) | set(LOCAL_OUTCOMES) | set(FALLBACK_REASONS)
                       | set(NOTICE_OUTCOMES))
        seen = set()
        for family in srv.metrics.registry.collect():
            for sample in family.samples:
                for name, value in sample.labels.items():
                    if name != "le":  # histogram bucket bounds
                        seen.add(value)
                assert "pwned" not in sample.name
        assert seen <= allowed, seen - allowed
        assert {"model_not_found", "bad_request"} <= seen and seen & {"routed", "fallback"}  # all were counted
