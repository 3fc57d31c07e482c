"""Labels that set a baseline policy's parameters in `astrolabe bench cluster` (for tuning it per fleet)."""

import random

import pytest

from bench.cluster import policy_spec
from bench.cluster_sim import build_sim_policy


def test_a_label_sets_the_policys_parameters():
    spec = policy_spec("llm-d:max_tokens_in_flight_penalty=50000:affinity_threshold=0.9", 12)
    assert (spec.label, spec.name) == ("llm-d:max_tokens_in_flight_penalty=50000:affinity_threshold=0.9", "llm-d")
    assert spec.params == {"max_tokens_in_flight_penalty": 50000, "affinity_threshold": 0.9}
    policy = build_sim_policy(spec, random.Random(0))
    assert policy.params.max_tokens_in_flight_penalty == 50000 and policy.params.affinity_threshold == 0.9
    assert policy_spec("dynamo-kv-precise:overlap_score_weight=2", 12).params == {"overlap_score_weight": 2}


@pytest.mark.parametrize("label", ["llm-d:penalty", "nope:a=1", "astrolabe:k=2", "astrolabe-k2:cache_affinity"])
def test_bad_labels(label):
    with pytest.raises(ValueError):
        policy_spec(label, 12)


def test_a_parameter_the_policy_does_not_take_fails_when_built():
    with pytest.raises(ValueError, match="unknown parameter"):
        build_sim_policy(policy_spec("sglang-cache-aware:tau=1", 12), random.Random(0))


def test_an_astrolabe_label_takes_parameters_after_its_modifiers():
    spec = policy_spec("astrolabe-k2-noextra:cache_affinity=false:max_load_ratio=0", 12)
    assert spec.name == "astrolabe"
    assert spec.params == {"k": 2, "extra_probes": 0, "cache_affinity": False, "max_load_ratio": 0}
    policy = build_sim_policy(spec, random.Random(0))
    assert policy.params.cache_affinity is False and policy.params.max_load_ratio == 0
