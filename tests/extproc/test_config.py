import pytest

from extproc.config import ConfigError, load_config, parse_config, parse_ip_port

GOOD = {"endpoints": [{"address": "127.0.0.1:8001", "models": ["m"], "predictor": "127.0.0.1:9001"},
                      {"address": "[::1]:8002"}]}


def test_defaults_and_endpoints():
    config = parse_config(GOOD)
    assert config.policy == "astrolabe" and config.max_body_bytes == 8 * 1024 * 1024
    assert config.endpoints[0].models == ("m",) and config.endpoints[0].predictor == "127.0.0.1:9001"
    assert config.endpoints[1].address == "[::1]:8002" and config.endpoints[1].models == ()
    assert config.health_check.enabled and config.health_check.path == "/health"


def test_load_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("policy: least-requests\nhealth_check: {enabled: false}\n"
                    "endpoints:\n  - address: 10.1.2.3:8000\n    models: [a, b]\n")
    config = load_config(path)
    assert config.policy == "least-requests" and not config.health_check.enabled
    assert config.endpoints[0].models == ("a", "b")


@pytest.mark.parametrize(
    "raw, message",
    [
        ([], "<root>: expected a mapping"),
        ({}, "endpoints: required"),
        ({"endpoints": [], "polcy": "x"}, "<root>: unknown key(s) ['polcy']"),
        ({"endpoints": [{"address": "localhost:80"}]}, "endpoints[0].address: 'localhost' is not an IP"),
        ({"endpoints": [{"address": "1.2.3.4"}]}, "endpoints[0].address: expected 'ip:port'"),
        ({"endpoints": [{"address": "1.2.3.4:0"}]}, "endpoints[0].address: port '0'"),
        ({"endpoints": [{"address": "1.2.3.4:1"}, {"address": "1.2.3.4:1"}]}, "endpoints[1].address: duplicate"),
        ({"endpoints": [{"address": "1.2.3.4:1", "modls": []}]}, "endpoints[0]: unknown key(s) ['modls']"),
        ({"endpoints": [{"address": "1.2.3.4:1", "models": "m"}]}, "endpoints[0].models"),
        ({"endpoints": [{"models": ["m"]}]}, "endpoints[0].address: required"),
        ({"endpoints": [], "policy": "best"}, "policy: unknown policy 'best'"),
        ({"endpoints": [], "policy": "round-robin", "policy_params": {"k": 2}},
         "policy: policy 'round-robin' takes no parameters"),
        ({"endpoints": [], "policy_params": {"k": 0}}, "policy: policy 'astrolabe': k must be an integer >= 1"),
        ({"endpoints": [], "policy_params": {"j": 0}}, "policy: policy 'astrolabe': unknown parameter(s) ['j']"),
        ({"endpoints": [], "output_length": {"source": "guess"}}, "output_length.source: must be one of"),
        ({"endpoints": [], "output_length": {"fixed_tokens": 0}}, "output_length.fixed_tokens: must be > 0"),
        ({"endpoints": [], "predictor_client": {"predict_timeout_s": "1"}}, "predictor_client.predict_timeout_s"),
        ({"endpoints": [], "max_body_bytes": 0}, "max_body_bytes: must be >= 1"),
        ({"endpoints": [], "max_body_bytes": True}, "<root>.max_body_bytes: expected"),
        ({"endpoints": [], "health_check": {"interval_s": 0}}, "health_check.interval_s: must be > 0"),
        ({"endpoints": [], "health_check": {"path": "health"}}, "health_check.path: must start with '/'"),
        ({"endpoints": [], "health_check": {"every": 1}}, "health_check: unknown key(s) ['every']"),
        ({"endpoints": [], "listen": "nowhere"}, "listen: expected 'host:port'"),
    ],
)
def test_errors_name_the_key(raw, message):
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert str(info.value).startswith(message), str(info.value)


def test_unreadable_and_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("endpoints: [\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)


def test_ip_port_normalised():
    assert parse_ip_port("[0:0::1]:80", "x") == "[::1]:80"
    assert parse_ip_port("127.0.0.1:0080", "x") == "127.0.0.1:80"


@pytest.mark.parametrize(
    "extra, interval_s, staleness_s",
    [({}, 0.05, 2.0), ({"metrics_interval_s": 0.2, "metrics_staleness_s": 5}, 0.2, 5.0)],
    ids=["defaults-as-gie", "set"],
)
def test_metrics_scrape_keys(extra, interval_s, staleness_s):
    config = parse_config({**GOOD, "policy": "gie", **extra})
    assert (config.metrics_interval_s, config.metrics_staleness_s) == (interval_s, staleness_s)


@pytest.mark.parametrize(
    "extra, message",
    [({"metrics_interval_s": 0}, "metrics_interval_s: must be > 0"),
     ({"metrics_staleness_s": -1}, "metrics_staleness_s: must be > 0"),
     ({"metrics_interval_s": "fast"}, "metrics_interval_s: expected"),
     ({"policy": "gie", "policy_params": {"prefix_weight": 3}}, "policy: policy 'gie': unknown parameter")],
    ids=["zero-interval", "negative-staleness", "string-interval", "gie-bad-param"],
)
def test_metrics_scrape_key_errors(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({**GOOD, **extra})
