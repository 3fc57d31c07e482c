"""Wire keys shared with Envoy and the Gateway API Inference Extension (Endpoint Picker protocol).

Source: gateway-api-inference-extension pkg/epp/metadata/consts.go and docs/proposals/004-endpoint-picker-protocol.
"""

DESTINATION_HEADER = "x-gateway-destination-endpoint"
"""Request header that carries the chosen ``ip:port`` (ORIGINAL_DST cluster reads it)."""

DESTINATION_SUBSET_HEADER = "x-gateway-destination-endpoint-subset"
"""The gateway's subset hint: a list of ``ip:port`` (or one comma-separated string) in the request's filter
metadata under `SUBSET_HINT_NAMESPACE`; the picker must choose among them, and answers 503 when none is eligible.
Also a request header that Envoy must strip from clients (our configs do)."""

SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
"""Filter-metadata namespace of the subset hint (protocol v0.3)."""

LB_METADATA_NAMESPACE = "envoy.lb"
"""Dynamic metadata namespace in which the chosen endpoint is also published, under DESTINATION_HEADER."""

DESTINATION_SERVED_KEY = "x-gateway-destination-endpoint-served"
"""Key under `LB_METADATA_NAMESPACE` in the response's metadata context: the ``ip:port`` that served the request
(protocol v1.0), which differs from the first endpoint when the gateway went down the fallback list."""

REQUEST_ID_HEADER = "x-request-id"
"""Envoy's request id; a stream without one gets a generated id."""

CONTENT_TYPE_JSON = b"application/json"

EXT_PROC_SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
"""gRPC health service name Envoy's health checker asks about."""

HEALTH_SERVICE_NAMES = ("", "liveness", "readiness", EXT_PROC_SERVICE_NAME)
"""Every gRPC health service name the server reports."""

MAX_STREAMED_CHUNK_BYTES = 62 * 1024
"""Largest body chunk re-sent to Envoy in FULL_DUPLEX_STREAMED mode (GIE uses 62 KB, under Envoy's 64 KB frames)."""
