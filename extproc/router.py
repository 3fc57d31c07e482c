"""Protocol-free routing: ``RoutingRequest`` -> ``Decision``, using the pool, the policy and the predictors.

Failure policy (the only place it is decided):
- the requested model is served by no configured endpoint -> MODEL_NOT_FOUND (404);
- endpoints serve it but none is healthy -> NO_HEALTHY_ENDPOINT (503);
- a sheddable request (priority < 0) that the admission rule refuses on the probed candidates' predictions -> SHED
  (429, with ``retry-after`` and the drop-reason header: ``extproc/admission.py``); priority >= 0 is never refused;
- a prediction policy got no usable prediction (no sidecar, sidecars failed or late) -> ``least-requests`` over
  all healthy endpoints, counted as outcome ``fallback``; a sidecar failure never fails a request.

Where predictions come from: with ``fleet`` (``predictor_client.mode: watch``, the default) each candidate is
predicted here from its sidecar's streamed state, with this replica's own dispatches that the state does not
include yet queued in (``extproc/fleet_state.py``): no round trip, and decisions of this replica always see each
other. A sidecar that does not stream (and every sidecar in mode ``predict``) is asked by Predict:

Decisions that see each other: each Predict asks its sidecar to hold the request (``predictor/holds.py``), so a
sidecar answers every later Predict, from any replica, with it counted; after choosing, the router confirms the
hold at the chosen sidecar (Admit) and drops it at the others (Release). A sidecar leaves this replica's own
holds out of its answers to it: this replica knows its own decisions exactly instead. Its Admits are numbered, each
answer says up to which one it includes (``admits_seen``), and the ones it does not include reach the policy as
``EndpointView.num_unseen_dispatches``, priced at the answer's cost of one more request like this one
(``Prediction.ttft_s_per_request``).

Every decision has a *basis*, counted in ``astrolabe_extproc_decisions_total{basis}``: ``prediction`` (every
probed sidecar answered), ``partial`` (some did: the policy's rule for a partial answer decided), ``shed`` (refused
with 429: a sheddable request the admission rule refused on the probed candidates' predictions,
``extproc/admission.py``; also counted in ``astrolabe_extproc_shed_total{reason,priority}``),
``fallback`` (none did: least-requests decided), ``policy`` (a policy that does not predict) or ``no_prompt`` (a
request without a prompt, e.g. ``GET /v1/models``, under a predicting policy: least-requests, no sidecar asked or
told). A fallback
carries its reason (`FALLBACK_REASONS`). With ``decision_log`` set, each decision is also written as one JSON
record (``extproc.decision_log``). With a tracer, the length estimate is a child span of the current span (the
stream's request span); so is each candidate predicted here from its sidecar's state (``astrolabe.predict``); the
Predict and Admit calls get theirs from the predictor client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from astrolabe.tracing import (ADMIT_ID, LENGTH_ESTIMATE_SPAN, LOCAL_PREDICT_SPAN, NUM_PREDICTED_OUTPUT_TOKENS,
                               PREDICTED_E2E_S, PREDICTED_QUEUE_S, PREDICTED_TTFT_S, SERVER_ADDRESS, STATE_AGE_S)
from extproc.admission import DROP_REASON_HEADER, AdmissionParams, CriticalPressure, HeaderObjectives, ObjectiveConfig, \
    shed_reason
from extproc.decision import Decision
from extproc.decision_log import DecisionLog
from extproc.endpoint_metrics import MetricsScraper
from extproc.errors import ErrorCode, RoutingError
from extproc.fleet_state import FleetState
from extproc.lengths import OutputLengthEstimator, capped_output_tokens
from extproc.objectives import NO_OBJECTIVES, Objectives
from extproc.prompt_tokens import PromptTokenCounter, PromptTokens
from extproc.metrics import ExtprocMetrics
from extproc.policies.base import EndpointView, Policy
from extproc.policies.least_requests import LeastRequestsPolicy
from extproc.pool import EndpointPool
from extproc.predictor_client import PredictorClient
from extproc.request import RoutingRequest
from extproc.spans import LENGTH_SOURCE, LENGTH_SOURCE_LABELS, host_port
from predictor.sim.request import vllm_priority

logger = logging.getLogger(__name__)

BASIS_SHED = "shed"
"""The basis of a refused request (``extproc.admission``): counted and logged, never routed."""
BASIS_NO_PROMPT = "no_prompt"
"""The basis of a request without a prompt under a predicting policy: least-requests, no Predict, no Admit."""
FALLBACK_NO_SIDECAR = "no_sidecar"
"""No probed candidate has a predictor sidecar."""
FALLBACK_NO_PREDICTION = "no_prediction"
"""Every probed sidecar failed, was late, was backing off, answered from a stale state or could not serve it."""
FALLBACK_NO_METRICS = "no_metrics"
"""A metrics policy found no endpoint with a fresh scrape."""
FALLBACK_UNDECIDED = "policy_undecided"
"""Any other policy that could not decide."""
CONSECUTIVE_5XX = 5
"""5xx answers in a row that eject an endpoint (passive; Envoy's outlier detection default ``consecutive_5xx``)."""
OFFLOAD_CHAT_MESSAGES = 64
"""A chat with more messages is keyed in a worker thread too (its template renders ~0.09 ms a message)."""

OFFLOAD_TOKENIZE_CHARS = 8192
"""A prompt longer than this (characters) is tokenized in full for its block keys in a worker thread: tokenizing
takes about 0.25 ms per 1,000 characters here (`astrolabe bench prompt-keys`: 42 ms at 32,000 tokens), and
``tokenizers``' ``encode_batch_fast`` releases the GIL while it runs (the event loop's longest stall while a
1.2-MB text was tokenized in a thread: 12.5 ms, against 643 ms with ``encode``), so the other requests' streams
are served meanwhile. Shorter prompts are tokenized inline (a thread hop costs more than they do)."""
FALLBACK_REASONS = (FALLBACK_NO_SIDECAR, FALLBACK_NO_PREDICTION, FALLBACK_NO_METRICS, FALLBACK_UNDECIDED)
"""Every ``Decision.fallback_reason`` but "" (a bounded set: fit for metric labels)."""


class Router:
    """Chooses endpoints, counts each replica's in-flight requests, and keeps sidecars informed.

    Args:
        pool: the endpoint pool (shared with the health checker and config reloads).
        policy: the dispatch policy.
        metrics: where routing time and outcomes are counted (a private registry if None).
        predictors: sidecar client; required when the policy needs predictions.
        lengths: output-length estimator; required when the policy needs predictions.
        rng: seeds the fallback's tie-breaking.
        endpoint_metrics: source of ``EndpointView.metrics`` for policies that ``needs_metrics`` (None: every
            endpoint's metrics read None and such a policy falls back).
        clock: monotonic clock, seconds (dispatch times for ``num_recent_requests``, routing overhead).
        decision_log: where each decision is recorded (None = nowhere).
        prompt_tokens: counts prompt tokens per served model and computes the prompt's block keys
            (``extproc.prompt_tokens``); None = the shipped WordPiece for every model, no block keys.
        tracer: where the length-estimate span is started (None: no span, tracing off).
        num_fallbacks: endpoints listed after the chosen one (``Decision.fallbacks``, the config's
            ``fallback_endpoints``): the other probed candidates by their predicted latency, then the healthy
            endpoints by this replica's in-flight count.
        passive_ejection: when the gateway reports that another endpoint served a request (it could not use the
            chosen one and went down the list), the chosen endpoint counts as unhealthy until its next passing
            active health check; only with active health checks on (else nothing would bring it back).
        fleet: the sidecars' streamed states (``predictor_client.mode`` watch): candidates whose sidecar it covers
            are predicted here, without a round trip; None = every prediction is a Predict call.
        objectives: the configured objectives (``extproc.admission.ObjectiveConfig``): what `resolve_objectives`
            makes of a request's headers.
        admission: when a sheddable request is refused (``extproc.admission``; a predicting policy only).
        engine_priority: the endpoints run vLLM's ``--scheduling-policy priority``: each routed request carries
            its objectives' priority to the engine (`engine_priority_of`, written into the body by
            ``extproc/stream.py``), and its predictions and Admits carry it to the sidecars.
    """

    def __init__(self, pool: EndpointPool, policy: Policy, metrics: ExtprocMetrics | None = None,
                 predictors: PredictorClient | None = None, lengths: OutputLengthEstimator | None = None,
                 rng: random.Random | None = None, endpoint_metrics: MetricsScraper | None = None,
                 clock=time.monotonic, decision_log: DecisionLog | None = None,
                 prompt_tokens: PromptTokenCounter | None = None, tracer: trace.Tracer | None = None,
                 num_fallbacks: int = 0, passive_ejection: bool = False, fleet: FleetState | None = None,
                 objectives: ObjectiveConfig | None = None, admission: AdmissionParams | None = None,
                 engine_priority: bool = False) -> None:
        if policy.needs_predictions and (predictors is None or lengths is None):
            raise ValueError(f"policy {policy.TYPE!r} needs a predictor client and an output-length estimator")
        self.pool = pool
        self.policy = policy
        self.metrics = metrics or ExtprocMetrics(pool)
        self.predictors = predictors
        self.lengths = lengths
        self._fallback = LeastRequestsPolicy(rng or random.Random())
        self.endpoint_metrics = endpoint_metrics
        self._clock = clock
        self.decision_log = decision_log
        self.prompt_tokens = prompt_tokens if prompt_tokens is not None else PromptTokenCounter()
        self._tracer = tracer
        self._num_fallbacks = num_fallbacks
        self._passive_ejection = passive_ejection
        self._consecutive_5xx: dict[str, int] = {}
        self.fleet = fleet
        self.objectives = objectives or ObjectiveConfig()
        self.admission = admission or AdmissionParams()
        self._protect_ttft_s = self.objectives.protect_ttft_bound_s()
        self._pressure = CriticalPressure(self.admission.pressure_window_s)
        self.engine_priority = engine_priority

    def engine_priority_of(self, request: RoutingRequest) -> int | None:
        """The priority ``request`` carries to its engine (vLLM's request field ``priority``: lower = served earlier;
        ``predictor.sim.request.vllm_priority`` of its objectives' priority), or None when ``engine_priority`` is
        off (nothing is written; the engine sees what the client sent)."""
        return vllm_priority(request.objectives.priority) if self.engine_priority else None

    def resolve_objectives(self, headers: HeaderObjectives, model: str | None) -> Objectives:
        """A request's objectives from its headers (``extproc.admission.header_objectives``) and the config;
        every ignored or clamped header value is counted (``astrolabe_extproc_objective_headers_invalid_total``)."""
        for name in headers.invalid:
            self.metrics.objective_headers_invalid.labels(name).inc()
        return self.objectives.resolve(headers, model)

    def _healthy_views(self, request: RoutingRequest) -> list[EndpointView]:
        if not self.pool.endpoints:
            raise RoutingError(ErrorCode.NO_HEALTHY_ENDPOINT, "no endpoint is configured or discovered")
        serving = self.pool.serving(request.model)
        if not serving:
            raise RoutingError(ErrorCode.MODEL_NOT_FOUND, f"The model `{request.model}` does not exist.", "model")
        if request.allowed_endpoints is not None:
            allowed = request.allowed_endpoints
            serving = [e for e in serving if e.address in allowed or host_port(e.address)[0] in allowed]
            if not any(self.pool.is_healthy(e.address) for e in serving):
                raise RoutingError(ErrorCode.NO_HEALTHY_ENDPOINT,
                                   f"no healthy endpoint of the gateway's subset hint ({len(allowed)} usable "
                                   f"entries) serves the request")
        since_s = self._clock() - self.policy.recent_window_s
        scraper = self.endpoint_metrics if self.policy.needs_metrics else None
        healthy = [e for e in serving if self.pool.is_healthy(e.address)]
        if not healthy:
            raise RoutingError(ErrorCode.NO_HEALTHY_ENDPOINT,
                               f"no healthy endpoint serves model {request.model!r}" if request.model
                               else "no healthy endpoint")
        # mean_in_flight is set where a policy reads it: on the scored candidates, as of the choice
        # (`_with_current_load`)
        return [EndpointView(e.address, self.pool.in_flight(e.address), e.predictor,
                             metrics=scraper.get(e.address) if scraper is not None else None,
                             num_recent_requests=self.pool.num_dispatched_since(e.address, since_s))
                for e in healthy]

    async def route(self, request: RoutingRequest) -> Decision:
        """Chooses the destination and counts the request in flight there until ``release``.

        Raises:
            RoutingError: MODEL_NOT_FOUND or NO_HEALTHY_ENDPOINT.
        """
        start_s = self._clock()
        if not request.arrival_time_s:
            request = replace(request, arrival_time_s=start_s)
        views = self._healthy_views(request)
        has_prompt = request.prompt_text is not None or request.prompt_token_ids is not None
        tokens, tokens_s = None, 0.0
        keyed = self.prompt_tokens.block_size is not None and (self.policy.needs_block_keys
                                                                or self.policy.needs_predictions)
        if has_prompt and (self.policy.needs_predictions or keyed):
            prompt_tokens = self.prompt_tokens
            if keyed and (len(request.prompt_text or "") > OFFLOAD_TOKENIZE_CHARS
                          or len(request.prompt_token_ids or ()) > OFFLOAD_TOKENIZE_CHARS
                          or len(request.chat_messages or ()) > OFFLOAD_CHAT_MESSAGES):
                # tokenizers' encode_batch_fast releases the GIL: other streams go on meanwhile. The worker gets
                # the request in a box it empties: its work item outlives the answer for a moment, and must not
                # keep the prompt (megabytes) alive meanwhile.
                box, tokens_of = [request], prompt_tokens.tokens
                tokens = await asyncio.to_thread(lambda: tokens_of(box.pop()))
            else:
                tokens = prompt_tokens.tokens(request)
            tokens_s = self._clock() - start_s
            if tokens.block_keys is not None:
                request = replace(request, block_keys=tokens.block_keys)
                views = self._with_prefix_blocks(request, views)
        if self.policy.needs_predictions and not has_prompt:
            # No prompt (a GET such as /v1/models, a body without one): nothing to predict, nothing for a sidecar
            # to simulate or check against an outcome.
            chosen = self._fallback.choose(request, views)
            decision = Decision(chosen.address, self._fallback.TYPE, request.request_id, basis=BASIS_NO_PROMPT)
        elif self.policy.needs_predictions:
            decision = await self._route_predicted(request, views, tokens, tokens_s)
        else:
            chosen, policy_name = self.policy.choose(request, views), self.policy.TYPE
            basis = "policy"
            reason = ""
            if chosen is None:  # e.g. a metrics policy with no fresh scrape of any endpoint
                chosen, policy_name, basis = self._fallback.choose(request, views), self._fallback.TYPE, "fallback"
                reason = FALLBACK_NO_METRICS if self.policy.needs_metrics else FALLBACK_UNDECIDED
            decision = Decision(chosen.address, policy_name, request.request_id, basis=basis, fallback_reason=reason)
        # Every decision keeps it, fallbacks too: a sidecar that hears of the request later (`served`) needs its
        # max_tokens, block keys and priority as the chosen one had them; `release` tells the policy only of its own.
        decision = replace(decision, routed=replace(request, prompt_text=None, prompt_token_ids=None,
                                                    chat_messages=None, last_user_message=None))
        fallbacks = self._fallback_list(decision, views) if self._num_fallbacks else decision.fallbacks
        end_s = self._clock()
        decision = replace(decision, fallbacks=fallbacks, routing_s=end_s - request.arrival_time_s,
                           num_sequences=request.num_sequences, decided_at_s=end_s)
        self.pool.acquire(decision.destination, decision.num_sequences)
        self.pool.record_dispatch(decision.destination, end_s)
        self.metrics.routing_seconds.observe(end_s - start_s)
        self.metrics.count_request(self.policy.TYPE, "fallback" if decision.basis == "fallback" else "routed")
        self.metrics.decisions.labels(decision.basis).inc()
        if decision.fallback_reason:
            self.metrics.fallbacks.labels(decision.fallback_reason).inc()
        if self.decision_log is not None:
            self.decision_log.write(request, decision)
        logger.debug("request %s -> %s (%s, %s)", request.request_id, decision.destination, decision.policy,
                     decision.basis)
        return decision

    def _with_prefix_blocks(self, request: RoutingRequest, views: list[EndpointView]) -> list[EndpointView]:
        """``views`` with ``num_prefix_blocks_cached`` and ``num_prefix_blocks_in_use`` filled from each endpoint's
        sidecar's last watched state (``FleetState.prefix_blocks``; None where it has none); unchanged without
        watched states."""
        fleet = self.fleet
        if fleet is None:
            return views
        block_size = self.prompt_tokens.block_size
        filled = []
        for v in views:
            if not v.predictor:
                filled.append(v)
                continue
            cached, in_use = fleet.prefix_blocks(v.predictor, request.block_keys, block_size) or (None, None)
            filled.append(replace(v, num_prefix_blocks_cached=cached, num_prefix_blocks_in_use=in_use))
        return filled

    async def _route_predicted(self, request: RoutingRequest, views: list[EndpointView], tokens: PromptTokens,
                               tokens_s: float) -> Decision:
        """A predicting policy's decision; ``tokens``: the prompt's (counted in ``tokens_s`` seconds)."""
        candidates = self.policy.candidates(request, views)
        ledger_id = f"{request.request_id}/{uuid.uuid4().hex[:12]}"
        num_prompt_tokens = tokens.num_tokens
        block_keys, block_size = request.block_keys, self.prompt_tokens.block_size or 0
        priority = self.engine_priority_of(request) or 0
        t1_s = self._clock()
        # before the max_tokens cap: the sidecars (and `fleet`) price E[min(L, max_tokens)] (extproc/lengths.py)
        num_output_tokens, length_source = await self._estimate_length(request)
        t2_s = self._clock()
        self.metrics.length_estimate_seconds.observe(t2_s - t1_s)
        metric = getattr(getattr(self.policy, "params", None), "metric", "e2e")
        objectives = request.objectives
        num_capped_tokens = capped_output_tokens(num_output_tokens, request.max_tokens)
        if objectives is not NO_OBJECTIVES:  # a TPOT objective is checked with the estimate
            request = replace(request, num_predicted_output_tokens=num_capped_tokens)

        # sidecar -> (Admits this replica had sent it, of which not answered yet) when this Predict was sent
        asked_at: dict[str, tuple[int, int]] = {}

        fleet = self.fleet
        remote: set[str] = set()  # sidecars asked by Predict (they hold the request)

        def local_predict(predictor: str):
            start_s = self._clock()
            span_scope = (contextlib.nullcontext() if self._tracer is None else self._tracer.start_as_current_span(
                LOCAL_PREDICT_SPAN, attributes={SERVER_ADDRESS: host_port(predictor)[0], ADMIT_ID: ledger_id}))
            try:
                with span_scope as span:
                    prediction = fleet.predict(predictor, num_prompt_tokens, num_output_tokens,
                                               max_tokens=request.max_tokens, length_source=length_source,
                                               block_keys=block_keys, block_size=block_size, priority=priority)
                    if span is not None and span.is_recording() and prediction is not None:
                        span.set_attributes({PREDICTED_TTFT_S: prediction.ttft_s, PREDICTED_E2E_S: prediction.e2e_s,
                                             PREDICTED_QUEUE_S: prediction.queue_s,
                                             STATE_AGE_S: prediction.state_age_s})
                    elif span is not None and span.is_recording():
                        span.set_status(Status(StatusCode.ERROR, "no prediction"))
                    return prediction
            finally:
                self.metrics.predict_seconds.labels(predictor).observe(self._clock() - start_s)

        async def timed_predict(predictor: str):
            start_s = self._clock()
            remote.add(predictor)
            asked_at[predictor] = (self.predictors.num_admitted(predictor),
                                   self.predictors.num_admits_pending(predictor))
            try:
                return await self.predictors.predict(predictor, ledger_id, num_prompt_tokens, num_output_tokens,
                                                     metric, max_tokens=request.max_tokens,
                                                     length_source=length_source, block_keys=block_keys,
                                                     block_size=block_size, priority=priority)
            finally:
                self.metrics.predict_seconds.labels(predictor).observe(self._clock() - start_s)

        async def ask(views_: Sequence[EndpointView]) -> list[EndpointView]:
            """Predictions for ``views_``: Predict calls first (if any), then the local ones, with no await between
            them and the choice, so that they include every dispatch this replica made before it."""
            asked = [v.predictor for v in views_ if v.predictor and not (fleet is not None and fleet.covers(v.predictor))]
            answers = dict(zip(asked, await asyncio.gather(*map(timed_predict, asked)))) if asked else {}
            return [replace(v, prediction=None if not v.predictor else answers[v.predictor] if v.predictor in answers
                            else local_predict(v.predictor)) for v in views_]

        scored = await ask(candidates)
        more = self.policy.more_candidates(request, scored, views)
        if more:  # every first-round candidate would queue: a second round
            scored += await ask(more)
            candidates = [*candidates, *more]
        scored = self._with_current_load(scored, views, asked_at)
        predictions = [v.prediction for v in scored]
        stage_s = (("tokens", tokens_s), ("length", t2_s - t1_s), ("predict", self._clock() - t2_s))
        num_ok = sum(p is not None for p in predictions)
        self.metrics.predictions.labels("ok").inc(num_ok)
        self.metrics.predictions.labels("failed").inc(sum(v.predictor is not None for v in candidates) - num_ok)
        now_s = self._clock()
        self._pressure.observe(objectives, scored, now_s, self._protect_ttft_s)
        if objectives.sheddable and self.admission.rule != "none":
            reason = shed_reason(objectives, scored, num_capped_tokens, self.admission.rule, self._protect_ttft_s,
                                 self._pressure.active(now_s))
            if reason is not None:
                if self.predictors.config.hold_s:  # every sidecar asked held the request: drop it
                    for predictor in remote:
                        if not self.predictors.is_backing_off(predictor):
                            self.predictors.release(predictor, ledger_id)
                self._refuse(request, reason, Decision(
                    "", self.policy.TYPE, ledger_id, None, BASIS_SHED,
                    tuple((v.address, p) for v, p in zip(candidates, predictions)), num_prompt_tokens,
                    num_output_tokens, length_source, stage_s=stage_s, shed_reason=reason,
                    prefix_blocks_cached=tuple(v.num_prefix_blocks_cached for v in scored)))
        chosen = self.policy.choose(request, scored)
        policy_name = self.policy.TYPE
        basis = "prediction" if num_ok == len(candidates) else "partial"
        reason = ""
        if chosen is None:  # on this replica's in-flight counts of now: concurrent decisions went on meanwhile
            current = [replace(v, num_in_flight=self.pool.in_flight(v.address)) for v in views]
            chosen, policy_name, basis = self._fallback.choose(request, current), self._fallback.TYPE, "fallback"
            reason = FALLBACK_NO_PREDICTION if any(v.predictor for v in candidates) else FALLBACK_NO_SIDECAR
        if self.predictors.config.hold_s:  # the sidecars not chosen held the request (predictor/holds.py): drop it
            for predictor in remote:
                if predictor != chosen.predictor and not self.predictors.is_backing_off(predictor):
                    self.predictors.release(predictor, ledger_id)
        if chosen.predictor:
            used = chosen.prediction  # what the chosen sidecar answered: it checks it against the outcome
            self.predictors.admit(chosen.predictor, ledger_id, num_prompt_tokens, num_output_tokens,
                                  max_tokens=request.max_tokens, length_source=length_source,
                                  predicted_ttft_s=used.ttft_s if used else 0.0,
                                  predicted_e2e_s=used.e2e_s if used else 0.0, block_keys=block_keys,
                                  block_size=block_size, priority=priority)
        return Decision(chosen.address, policy_name, ledger_id, chosen.predictor, basis,
                        tuple((v.address, p) for v, p in zip(candidates, predictions)), num_prompt_tokens,
                        num_output_tokens, length_source, stage_s=stage_s, fallback_reason=reason,
                        prefix_blocks_cached=tuple(v.num_prefix_blocks_cached for v in scored),
                        num_prompt_blocks=None if request.block_keys is None else len(request.block_keys))

    def _refuse(self, request: RoutingRequest, reason: str, decision: Decision) -> None:
        """Counts, logs and raises the refusal of ``request`` (``decision``: what the probes said, basis
        `BASIS_SHED`).

        Raises:
            RoutingError: always, SHED (429) with ``retry-after`` and the drop-reason header.
        """
        priority = request.objectives.priority
        self.metrics.shed.labels(reason, str(priority)).inc()
        self.metrics.decisions.labels(BASIS_SHED).inc()
        end_s = self._clock()
        decision = replace(decision, routing_s=end_s - request.arrival_time_s, decided_at_s=end_s)
        self.metrics.routing_seconds.observe(end_s - request.arrival_time_s)
        if self.decision_log is not None:
            self.decision_log.write(request, decision)
        best_s = min((p.ttft_s for _, p in decision.candidates if p is not None), default=None)
        predicted = f"; best predicted TTFT {best_s:.3f} s" if best_s is not None else ""
        logger.debug("request %s refused (%s, priority %d)%s", request.request_id, reason, priority, predicted)
        raise RoutingError(ErrorCode.SHED, f"The request was refused to protect latency objectives ({reason}, "
                                            f"priority {priority}{predicted}); retry later.",
                           reason=reason, headers=((DROP_REASON_HEADER, reason),
                                                   ("retry-after", str(self.admission.retry_after_s))))

    def _with_current_load(self, scored: list[EndpointView], views: Sequence[EndpointView],
                           asked_at: dict[str, tuple[int, int]]) -> list[EndpointView]:
        """``scored`` as of now: this replica's in-flight counts (concurrent decisions may have dispatched since
        the views were taken) and, per answered candidate, the requests this replica sent there that its sidecar's
        answer does not include (``num_unseen_dispatches``, priced by the policy).

        Unseen = this replica's Admits to that sidecar beyond the last one the answer includes (``admits_seen``,
        protocol v1.1: exact whatever the order in which the sidecar handled them), at most the Admits sent since
        the Predict plus those still unanswered then (a restarted sidecar, which knows none, is not charged with
        every Admit ever sent). From a v1.0 sidecar that bound is the estimate."""
        pool = self.pool
        in_flight = {v.address: pool.in_flight(v.address) for v in views}
        mean_in_flight = sum(in_flight.values()) / len(in_flight) if in_flight else 0.0
        updated = []
        for v in scored:
            unseen = 0
            if v.prediction is not None and v.predictor in asked_at:
                sent_then, pending_then = asked_at[v.predictor]
                sent_now = self.predictors.num_admitted(v.predictor)
                bound = sent_now - sent_then + pending_then
                seen = v.prediction.num_admits_seen
                unseen = bound if seen < 0 else max(min(sent_now - seen, bound), 0)
            updated.append(replace(v, num_in_flight=in_flight.get(v.address, v.num_in_flight),
                                   mean_in_flight=mean_in_flight, num_unseen_dispatches=unseen))
        return updated

    async def _estimate_length(self, request: RoutingRequest) -> tuple[int, int]:
        """``lengths.estimate_before_cap``, in a child span of the current one when tracing."""
        if self._tracer is None:
            return await self.lengths.estimate_before_cap(request)
        with self._tracer.start_as_current_span(LENGTH_ESTIMATE_SPAN) as span:
            num_output_tokens, length_source = await self.lengths.estimate_before_cap(request)
            if span.is_recording():
                span.set_attributes({NUM_PREDICTED_OUTPUT_TOKENS: num_output_tokens,
                                     LENGTH_SOURCE: LENGTH_SOURCE_LABELS.get(length_source, "unspecified")})
        return num_output_tokens, length_source

    def _fallback_list(self, decision: Decision, views: Sequence[EndpointView]) -> tuple[str, ...]:
        """Up to ``num_fallbacks`` endpoints after ``decision.destination``: the probed candidates that answered,
        best first by the policy's own ``score`` of their predictions (what it chose by), then the other healthy
        endpoints, fewest in flight first."""
        answered = sorted((self.policy.score(EndpointView(address, prediction=p)), address)
                          for address, p in decision.candidates if p is not None and address != decision.destination)
        ranked = [address for _, address in answered]
        taken = {decision.destination, *ranked}
        ranked += [v.address for v in sorted(views, key=lambda v: (v.num_in_flight, v.address))
                   if v.address not in taken]
        return tuple(ranked[:self._num_fallbacks])

    def served(self, decision: Decision, address: str) -> Decision:
        """The gateway reports that ``address`` served the request ``decision`` routed (it went down the fallback
        list, or chose itself): the in-flight count moves there, the chosen sidecar is released (the request never ran there) and
        the serving endpoint's sidecar, if any, is told (Admit, without a prediction).

        A served endpoint that is not in the list (the gateway's own choice after the list was used up, or with
        no list) moves the count the same way, if it is an endpoint of the pool. With ``passive_ejection`` a
        fallback of the list serving makes the chosen endpoint unhealthy until its next passing active check.

        Returns:
            The decision now pointing at ``address`` (``served_elsewhere``); ``decision`` itself when ``address``
            is its destination or no endpoint of the pool (a report to ignore).
        """
        if address == decision.destination or not self.pool.has(address):
            return decision
        self.pool.release(decision.destination, decision.num_sequences)
        self.pool.acquire(address, decision.num_sequences)
        self.metrics.served_elsewhere.inc()
        if self._passive_ejection and address in decision.fallbacks and self.pool.is_healthy(decision.destination):
            # The gateway went down the list: the chosen endpoint refused or reset the connection. A dead backend
            # would otherwise attract traffic (its in-flight count falls to 0) until its active check fails.
            logger.warning("endpoint %s failed a request the gateway then served at %s: out of the pool until its "
                           "next passing health check", decision.destination, address)
            self.pool.set_healthy(decision.destination, False)
        predictor = self.pool.endpoint(address).predictor
        if self.predictors is not None:
            if decision.predictor:
                self.predictors.release(decision.predictor, decision.request_id)
            if predictor and decision.num_prompt_tokens:
                routed = decision.routed
                self.predictors.admit(predictor, decision.request_id, decision.num_prompt_tokens,
                                      decision.num_predicted_output_tokens,
                                      max_tokens=routed.max_tokens if routed is not None else None,
                                      length_source=decision.length_source,
                                      block_keys=routed.block_keys if routed is not None else None,
                                      block_size=self.prompt_tokens.block_size or 0,
                                      priority=(self.engine_priority_of(routed) or 0) if routed is not None else 0)
        logger.debug("request %s served by %s (chosen %s)", decision.request_id, address, decision.destination)
        return replace(decision, destination=address, predictor=predictor if decision.predictor else None,
                       candidates=(), served_elsewhere=True)

    def answered(self, decision: Decision, status: int) -> None:
        """The endpoint that served ``decision`` answered with HTTP ``status`` (its own answer, not Envoy's). With
        ``passive_ejection``, `CONSECUTIVE_5XX` 5xx answers in a row from one endpoint take it out of the pool until
        its next passing active health check (Envoy's outlier detection default, ``consecutive_5xx``: a backend
        that fails fast would otherwise attract traffic, its in-flight count always lowest); any other status
        resets its count."""
        address = decision.destination
        if status < 500:
            self._consecutive_5xx.pop(address, None)
            return
        count = self._consecutive_5xx.get(address, 0) + 1
        self._consecutive_5xx[address] = count
        if count >= CONSECUTIVE_5XX and self._passive_ejection and self.pool.has(address) \
                and self.pool.is_healthy(address):
            logger.warning("endpoint %s answered %d requests in a row with 5xx (last %d): out of the pool until its "
                           "next passing health check", address, count, status)
            self.pool.set_healthy(address, False)
            self._consecutive_5xx.pop(address, None)
            self.metrics.consecutive_5xx_ejections.inc()

    def connect_failed(self, decision: Decision, address: str) -> None:
        """The gateway reports that ``address`` failed the request ``decision`` routed: it could not connect (its
        local 503 after the retries: ``response.code_details`` ``upstream_reset_before_response_started{...
        connection_failure...}``, Envoy's `ResponseCodeDetails`) or a per-try timeout fired (its 504,
        ``upstream_per_try_timeout`` / ``upstream_per_try_idle_timeout``: a frozen backend). With
        ``passive_ejection`` that endpoint leaves the pool until its next passing active health check, so that the
        requests after this one avoid it (without this a dead backend attracts traffic: its in-flight count falls to
        0). An address outside the pool, or already unhealthy, changes nothing."""
        if not self._passive_ejection or not self.pool.has(address) or not self.pool.is_healthy(address):
            return
        logger.warning("endpoint %s refused the connection or let a per-try timeout fire for request %s: out of the "
                       "pool until its next passing health check", address, decision.request_id)
        self.pool.set_healthy(address, False)
        self.metrics.connect_failures.inc()

    def release(self, decision: Decision, failed: bool = False) -> None:
        """The request routed by ``decision`` has ended (its ext_proc stream closed): its in-flight count drops,
        its sidecar is told, and the prediction that decided it (the chosen endpoint's, if it answered) is
        compared with the E2E observed since the decision (``astrolabe_extproc_prediction_ratio``), unless
        ``failed`` (the backend answered with an error: the sidecar is told so, and neither scores it). The policy
        hears of it (``Policy.on_finished``, with ``decision.routed`` and the endpoint that served it) when it chose
        the endpoint itself."""
        self.pool.release(decision.destination, decision.num_sequences)
        if decision.routed is not None and decision.policy == self.policy.TYPE and decision.basis != "fallback":
            try:
                self.policy.on_finished(decision.routed, decision.destination)
            except Exception:  # noqa: BLE001 (a policy's bookkeeping must not lose a release)
                logger.exception("policy %s failed on a finished request", self.policy.TYPE)
        if not self.pool.has(decision.destination):
            return  # the endpoint left the pool (discovery) while this request ran: its series and sidecar are gone
        predicted = next((p for address, p in decision.candidates if address == decision.destination), None)
        if predicted is not None and decision.decided_at_s and predicted.e2e_s > 0 and not failed:
            observed_s = self._clock() - decision.decided_at_s
            if observed_s > 0:
                ratio = predicted.e2e_s / observed_s
                self.metrics.prediction_ratio.labels(decision.destination, "e2e").observe(ratio)
        if decision.predictor and self.predictors is not None:
            self.predictors.release(decision.predictor, decision.request_id, failed=failed)
