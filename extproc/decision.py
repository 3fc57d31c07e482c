"""``Decision``: where a request goes and why, as the router made it (read by the stream, the decision log, metrics).

Imports only the standard library, ``extproc.policies.base`` and ``extproc.request``.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.policies.base import Prediction
from extproc.request import RoutingRequest


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes.

    Attributes:
        destination: ``ip:port`` written to the destination header and ``envoy.lb`` metadata.
        policy: name of the policy that chose it (``least-requests`` on a fallback).
        request_id: the id the chosen sidecar knows the request by (Admit / Release): the client's
            ``x-request-id`` made unique, since clients may reuse ids.
        predictor: the chosen endpoint's sidecar that was told about the request (Admit), or None.
        basis: ``prediction``, ``partial``, ``fallback``, ``policy`` or ``no_prompt`` (``extproc.router``).
        candidates: the probed endpoints with their predictions (None: no answer), probe order; empty when
            the policy does not predict.
        num_prompt_tokens: prompt tokens counted for the prediction (0 when not predicted).
        num_predicted_output_tokens: predicted output tokens, before the request's ``max_tokens`` cap, as the
            sidecars got them (0 when not predicted; ``extproc/lengths.py``).
        length_source: where the predicted output tokens came from (``predictor.residual_rules``).
        routing_s: from the request's arrival (its headers) to the decision, seconds.
        stage_s: seconds spent per stage of a predicted decision: ``tokens`` (counting prompt tokens),
            ``length`` (the output-length estimate), ``predict`` (the k Predict calls, concurrent); empty
            otherwise.
        fallback_reason: why the least-requests fallback decided (``extproc.router.FALLBACK_REASONS``); "" when
            the basis is not ``fallback``.
        decided_at_s: when the decision was made, on the router's monotonic clock, seconds (0: not recorded).
        fallbacks: more endpoints, in the order the gateway should try them after ``destination`` fails
            (``fallback_endpoints`` in the config; empty by default).
        served_elsewhere: the gateway reported that a fallback served the request: ``destination`` and
            ``predictor`` are now that endpoint's (moved by ``Router.served``).
        num_sequences: engine requests the HTTP request becomes (``RoutingRequest.num_sequences``): what it adds
            to the destination's in-flight count.
        prefix_blocks_cached: per candidate (same order), ``EndpointView.num_prefix_blocks_cached`` when it was
            probed (None: unknown); empty when the policy does not predict.
        num_prompt_blocks: full KV blocks of the prompt that had keys (``len(RoutingRequest.block_keys)``); None:
            no keys.
        shed_reason: why the request was refused (``extproc.admission.SHED_REASONS``; basis ``shed``, destination
            ""), or "".
        routed: the request as the policy saw it (its block keys included), less its prompt (text, token ids and
            messages: a routed request is not held in memory for its whole life), for ``Policy.on_finished``
            when it ends (only when the policy chose) and for the Admit of a sidecar that serves it elsewhere
            (``Router.served``: its ``max_tokens``, block keys and priority); set on every decision the router
            makes, None on one built without it.
    """

    destination: str
    policy: str
    request_id: str = ""
    predictor: str | None = None
    basis: str = "policy"
    candidates: tuple[tuple[str, Prediction | None], ...] = ()
    num_prompt_tokens: int = 0
    num_predicted_output_tokens: int = 0
    length_source: int = 0
    routing_s: float = 0.0
    stage_s: tuple[tuple[str, float], ...] = ()
    fallback_reason: str = ""
    decided_at_s: float = 0.0
    fallbacks: tuple[str, ...] = ()
    served_elsewhere: bool = False
    num_sequences: int = 1
    routed: RoutingRequest | None = None
    prefix_blocks_cached: tuple[int | None, ...] = ()
    num_prompt_blocks: int | None = None
    shed_reason: str = ""

    @property
    def destination_value(self) -> str:
        """The destination header's and metadata's value: ``ip:port[,ip:port...]``, the chosen endpoint first."""
        return ",".join((self.destination, *self.fallbacks))
