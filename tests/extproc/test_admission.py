import dataclasses
import math

import pytest

from extproc.admission import (
    MAX_OBJECTIVE_S,
    MIN_OBJECTIVE_S,
    NO_HEADER_OBJECTIVES,
    NO_OBJECTIVES,
    SHED_HEADROOM,
    SHED_SLO_UNREACHABLE,
    AdmissionParams,
    HeaderObjectives,
    ObjectiveConfig,
    Objectives,
    header_objectives,
    objective_header_values,
    meets,
    shed_reason,
)
from extproc.policies.base import EndpointView, Prediction

SHEDDABLE = Objectives(5.0, None, -1)
CRITICAL = Objectives(1.0, None, 0)


def view(ttft_s: float, e2e_s: float = 10.0, num_requests: int = 3, unseen: int = 0, per_request_s: float = 0.0):
    return EndpointView("10.0.0.1:80", prediction=Prediction(ttft_s, e2e_s, num_requests=num_requests,
                                                             ttft_s_per_request=per_request_s),
                        num_unseen_dispatches=unseen)


def test_headers_in_milliseconds_first_name_wins():
    got = header_objectives({"x-slo-ttft-ms": "800", "x-llm-d-slo-ttft-ms": "100", "x-llm-d-slo-tpot-ms": "50",
                             "x-gateway-inference-objective": " batch "})
    assert got == HeaderObjectives(0.8, 0.05, "batch", ())
    assert header_objectives({"x-llm-d-inference-objective": "chat"}).objective == "chat"
    assert header_objectives({}) is NO_HEADER_OBJECTIVES


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf", "abc", "", "1e400", "1_000", "0x10", "\u0661\u0660"])
def test_absurd_header_values_are_ignored_and_reported(value):
    got = header_objectives({"x-slo-ttft-ms": value})
    assert got.ttft_s is None and got.invalid == ("x-slo-ttft-ms",)


def test_a_huge_header_value_is_clamped_and_reported():
    got = header_objectives({"x-slo-tpot-ms": "1e15"})
    assert got.tpot_s == MAX_OBJECTIVE_S and got.invalid == ("x-slo-tpot-ms",)
    tiny = header_objectives({"x-slo-ttft-ms": "5e-324"})  # > 0 in ms, 0.0 once in seconds
    assert tiny.ttft_s == MIN_OBJECTIVE_S > 0 and tiny.invalid == ("x-slo-ttft-ms",)
    assert header_objectives({"x-slo-ttft-ms": "1.5e3"}).ttft_s == 1.5


def test_a_header_repeated_with_different_values_is_ignored_and_reported():
    pairs = [("x-slo-ttft-ms", "1e3"), ("x-slo-ttft-ms", "-1"), ("x-gateway-inference-objective", "chat"),
             ("x-gateway-inference-objective", "batch"), ("x-slo-tpot-ms", "50"), ("x-slo-tpot-ms", "50"),
             ("content-type", "a"), ("content-type", "b")]
    values = objective_header_values(pairs)
    assert values == {"x-slo-ttft-ms": None, "x-gateway-inference-objective": None, "x-slo-tpot-ms": "50"}
    got = header_objectives(values)
    assert got == HeaderObjectives(None, 0.05, None, ("x-slo-ttft-ms", "x-gateway-inference-objective"))


def test_priority_comes_only_from_a_configured_objective():
    config = ObjectiveConfig({"batch": Objectives(5.0, None, -1), "chat": Objectives(1.0, None, 0)},
                             {"llama": Objectives(2.0, None, -2)})
    assert config.resolve(HeaderObjectives(objective="batch"), "llama") == Objectives(5.0, None, -1)
    # an unknown name falls back to the model's default, then to the default
    assert config.resolve(HeaderObjectives(objective="vip"), "llama") == Objectives(2.0, None, -2)
    assert config.resolve(HeaderObjectives(objective="vip"), "other") == NO_OBJECTIVES
    # a header's objective only tightens the configured one (sets one where there is none); the priority stays
    assert config.resolve(HeaderObjectives(ttft_s=0.3, objective="batch"), None) == Objectives(0.3, None, -1)
    assert config.resolve(HeaderObjectives(tpot_s=0.05), "llama") == Objectives(2.0, 0.05, -2)
    # a looser header would let a sheddable client escape refusal: the configured objective stays
    assert config.resolve(HeaderObjectives(ttft_s=MAX_OBJECTIVE_S), "llama") == Objectives(2.0, None, -2)
    assert config.resolve(HeaderObjectives(ttft_s=9.0, objective="chat"), None) == Objectives(1.0, None, 0)


def test_protect_bound_defaults_to_half_the_tightest_non_sheddable_ttft_objective():
    config = ObjectiveConfig({"batch": Objectives(0.2, None, -1), "chat": Objectives(1.0, None, 0)},
                             {"m": Objectives(3.0, None, 1)})
    assert config.protect_ttft_bound_s() == 0.5
    assert ObjectiveConfig(protect_ttft_s=0.7).protect_ttft_bound_s() == 0.7
    assert ObjectiveConfig({"batch": Objectives(0.2, None, -1)}).protect_ttft_bound_s() is None


def test_config_entries_are_checked():
    from extproc.config import ConfigError, parse_config

    def objectives(section):
        return parse_config({"endpoints": [{"address": "10.0.0.1:80"}], "objectives": section}).objectives

    section = objectives({"named": {"batch": {"priority": -1, "ttft_ms": 500}}, "protect_ttft_ms": 300,
                          "admission": "slo", "retry_after_s": 3})
    assert section.objective_config().objectives == {"batch": Objectives(0.5, None, -1)}
    assert section.objective_config().protect_ttft_bound_s() == 0.3
    assert section.admission_params() == AdmissionParams("slo", 3)
    assert objectives(None).admission_params() == AdmissionParams()
    # YAML 1.1 reads an exponent without a point as a string: taken as the number it spells
    assert objectives({"protect_ttft_ms": "1e3"}).objective_config().protect_ttft_bound_s() == 1.0
    for bad in ({"named": {"b": {"priority": "high"}}}, {"named": {"b": {"ttft_ms": -1}}},
                {"models": {"m": {"ttft_ms": "fast"}}}, {"default": {"tpot_ms": math.inf}},
                {"named": {"b": {"deadline": 3}}}, {"named": {"b": {"priority": True}}},
                {"admission": "drop-everything"}, {"named": {"b": {"ttft_ms": 1e12}}}, {"retry_after_s": -1},
                {"named": {"b": {"priority": 2 ** 31}}}, {"default": {"priority": -(2 ** 31) - 1}},
                {"retry_after_s": 10 ** 29}, {"named": {"b": {"ttft_ms": "1e99"}}}):
        with pytest.raises(ConfigError, match="objectives"):
            objectives(bad)
    with pytest.raises(ValueError):
        AdmissionParams("drop-everything")
    with pytest.raises(ValueError):
        AdmissionParams(retry_after_s=-1)


def test_meets_checks_ttft_with_unseen_dispatches_and_tpot():
    assert meets(CRITICAL, view(0.9), 100)
    assert not meets(CRITICAL, view(0.9, unseen=2, per_request_s=0.1), 100)  # 0.9 + 2 x 0.1
    # TPOT: (E2E - TTFT) / (n - 1) = (10.9 - 0.9) / 100 = 0.1 s per token
    assert meets(Objectives(None, 0.1, 0), view(0.9, 10.9), 101)
    assert not meets(Objectives(None, 0.09, 0), view(0.9, 10.9), 101)
    assert meets(Objectives(None, 0.001, 0), view(0.9, 10.9), 1)  # a one-token reply has no TPOT
    assert meets(NO_OBJECTIVES, view(100.0), 10)


def test_slo_rule_refuses_a_sheddable_request_only_when_no_candidate_meets_it():
    assert shed_reason(SHEDDABLE, [view(6.0), view(7.0)], 100, "slo", None) == SHED_SLO_UNREACHABLE
    assert shed_reason(SHEDDABLE, [view(6.0), view(4.0)], 100, "slo", None) is None
    # priority >= 0 is never refused, whatever is predicted
    assert shed_reason(CRITICAL, [view(60.0)], 100, "slo", 0.5) is None
    assert shed_reason(SHEDDABLE, [view(60.0)], 100, "none", 0.5) is None


def test_headroom_rule_also_keeps_queues_under_its_bound():
    # meets its own 5 s objective, but would queue past the 0.5 s kept for critical work
    assert shed_reason(SHEDDABLE, [view(0.8), view(1.2)], 100, "headroom", 0.5) == SHED_HEADROOM
    assert shed_reason(SHEDDABLE, [view(0.8), view(0.4)], 100, "headroom", 0.5) is None
    assert shed_reason(SHEDDABLE, [view(0.8)], 100, "slo", 0.5) is None  # the slo rule has no bound
    assert shed_reason(SHEDDABLE, [view(0.8)], 100, "headroom", None) is None  # no bound configured


def test_an_idle_candidate_or_no_prediction_admits():
    # an idle instance admits whatever its (possibly cold) model predicts
    assert shed_reason(SHEDDABLE, [view(9.0), view(9.0, num_requests=0)], 100, "headroom", 0.5) is None
    # ... unless this replica sent it requests its answer does not include yet
    assert shed_reason(SHEDDABLE, [view(9.0, num_requests=0, unseen=1)], 100, "headroom", 0.5) is not None
    # ... or has requests in flight there that its sidecar does not count (an under-report)
    assert shed_reason(SHEDDABLE, [dataclasses.replace(view(9.0, num_requests=0), num_in_flight=2)], 100,
                       "headroom", 0.5) is not None
    nothing = EndpointView("10.0.0.2:80")
    assert shed_reason(SHEDDABLE, [nothing], 100, "headroom", 0.5) is None
    # a candidate without an answer is left out; the others decide
    assert shed_reason(SHEDDABLE, [nothing, view(9.0)], 100, "slo", None) == SHED_SLO_UNREACHABLE
    # a sheddable request without any objective is refused by the headroom bound only
    assert shed_reason(Objectives(None, None, -1), [view(9.0)], 100, "slo", None) is None
    assert shed_reason(Objectives(None, None, -1), [view(9.0)], 100, "headroom", 0.5) == SHED_HEADROOM


def test_critical_pressure_refuses_sheddable_work_for_a_window():
    from extproc.admission import SHED_PRESSURE, CriticalPressure

    pressure = CriticalPressure(2.0)
    pressure.observe(CRITICAL, [view(0.3), view(0.4)], 10.0, 0.5)  # it would start within the bound: no pressure
    pressure.observe(SHEDDABLE, [view(3.0)], 10.0, 0.5)  # a sheddable request's wait says nothing
    assert not pressure.active(10.0)
    pressure.observe(Objectives(), [view(0.9), view(3.0)], 11.0, 0.5)  # priority 0 waits past 0.5 s everywhere
    assert pressure.active(11.0) and pressure.active(13.0) and not pressure.active(13.1)
    # under pressure, a sheddable request that an instance could start at once is refused too
    assert shed_reason(SHEDDABLE, [view(0.1)], 100, "headroom", 0.5, under_pressure=True) == SHED_PRESSURE
    assert shed_reason(SHEDDABLE, [view(0.1)], 100, "slo", 0.5, under_pressure=True) is None
    assert shed_reason(CRITICAL, [view(0.1)], 100, "headroom", 0.5, under_pressure=True) is None
    never = CriticalPressure(0.0)
    never.observe(CRITICAL, [view(9.0)], 1.0, 0.5)
    assert not never.active(1.0)
    with pytest.raises(ValueError):
        AdmissionParams(pressure_window_s=-1)
