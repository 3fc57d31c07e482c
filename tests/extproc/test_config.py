import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from extproc import config as config_module
from astrolabe.tracing import TracingConfig
from extproc.config import (ENV_PREFIX, ConfigError, EndpointConfig, ExtprocConfig, HealthCheckConfig,
                            OutputLengthSection, PredictorClientSection, TracingSection, config_json_schema,
                            LIVE_KEYS, changed_keys, load_config, parse_config, parse_ip_port, replace_config)
from extproc.lengths import OutputLengthConfig
from extproc.policies.registry import POLICY_NAMES
from extproc.predictor_client import PredictorClientConfig

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
         "policy_params: policy 'round-robin' takes no parameters"),
        ({"endpoints": [], "policy_params": {"k": 0}}, "policy_params: policy 'astrolabe': k must be an integer >= 1"),
        ({"endpoints": [], "policy_params": {"j": 0}}, "policy_params: policy 'astrolabe': unknown parameter(s) ['j']"),
        ({"endpoints": [], "output_length": {"source": "guess"}}, "output_length.source: must be one of"),
        ({"endpoints": [], "output_length": {"fixed_tokens": 0}}, "output_length.fixed_tokens: must be > 0"),
        ({"endpoints": [], "predictor_client": {"predict_timeout_s": "1"}}, "predictor_client.predict_timeout_s"),
        ({"endpoints": [], "max_body_bytes": 0}, "max_body_bytes: must be >= 1"),
        ({"endpoints": [], "max_body_bytes": True}, "max_body_bytes: expected an integer, got True"),
        ({"endpoints": [], "health_check": {"interval_s": 0}}, "health_check.interval_s: must be > 0"),
        ({"endpoints": [], "health_check": {"path": "health"}}, "health_check.path: must start with '/'"),
        ({"endpoints": [], "health_check": {"every": 1}}, "health_check: unknown key(s) ['every']"),
        ({"endpoints": [], "listen": "nowhere"}, "listen: expected 'host:port'"),
        ({"endpoints": [], "fallback_endpoints": 8}, "fallback_endpoints: must be <= 7"),
        ({"discovery": {"source": "k8s"}}, "discovery.source: must be one of"),
        ({"discovery": {"source": "kubernetes"}}, "discovery.source: kubernetes needs exactly one of label_selector "
                                                  "and inference_pool"),
        ({"discovery": {"source": "kubernetes", "label_selector": "a=b", "inference_pool": "p"}},
         "discovery.source: kubernetes needs exactly one"),
        ({"discovery": {"source": "dns"}}, "discovery.dns_name: required when discovery.source is dns"),
        ({"discovery": {"source": "dns", "dns_name": "x", "predictor_port": "predictor"}},
         "discovery.predictor_port: dns discovery cannot read a named container port"),
        ({"discovery": {"source": "dns", "dns_name": "x", "dns_nameservers": ["ns.local"]}},
         "discovery.dns_nameservers[0]: expected 'ip' or 'ip:port'"),
        ({"discovery": {"source": "dns", "dns_name": "x", "dns_nameservers": ["10.0.0.1:99999"]}},
         "discovery.dns_nameservers[0]: port '99999' is not in 1..65535"),
        ({"discovery": {"source": "kubernetes", "label_selector": "a=b", "predictor_port": 0}},
         "discovery.predictor_port: port 0 is not in 1..65535"),
        ({"discovery": {"source": "kubernetes", "label_selector": "a=b", "predictor_port": "Bad_Name"}},
         "discovery.predictor_port: expected a port number or a container port name"),
        ({"discovery": {"source": "kubernetes", "label_selector": "a=b", "target_ports": []}},
         "discovery.target_ports"),
        ({"discovery": {"source": "dns", "dns_name": "x"}, "endpoints": [{"address": "10.0.0.1:8000"}]},
         "endpoints: must be empty when discovery.source is dns"),
        ({"discovery": {"source": "static"}}, "endpoints: required"),
        ({"discovery": {"source": "dns", "dns_name": "x", "inference_pool": "p"}},
         "discovery.source: dns discovery takes no label_selector or inference_pool"),
        ({"discovery": {"source": "kubernetes", "label_selector": "a=b", "dns_name": "x"}},
         "discovery.source: kubernetes discovery takes no dns_name"),
        ({"discovery": {"source": "dns", "dns_name": "x", "dns_interval": 1}},
         "discovery: unknown key(s) ['dns_interval']"),
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
     ({"policy": "gie", "policy_params": {"prefix_weight": 3}}, "policy_params: policy 'gie': unknown parameter")],
    ids=["zero-interval", "negative-staleness", "string-interval", "gie-bad-param"],
)
def test_metrics_scrape_key_errors(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({**GOOD, **extra})


# --- pydantic models: types, sections, defaults ------------------------------------------------------------

def _error(raw) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    return str(info.value)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"drain_delay_s": True}, "drain_delay_s: expected a number, got True"),
        ({"grace_period_s": "5"}, "grace_period_s: expected a number, got '5'"),
        ({"drain_delay_s": -1}, "drain_delay_s: must be >= 0"),
        ({"seed": 1.0}, "seed: expected an integer, got 1.0"),
        ({"seed": False}, "seed: expected an integer"),
        ({"health_check": {"enabled": "yes"}}, "health_check.enabled: expected a boolean"),
        ({"health_check": {"unhealthy_threshold": 0}}, "health_check.unhealthy_threshold: must be >= 1"),
        ({"health_check": 3}, "health_check: expected a mapping"),
        ({"predictor_client": {"max_loop_lag_s": 0}}, "predictor_client.max_loop_lag_s: must be > 0"),
        ({"predictor_client": {"late_backoff_after": True}}, "predictor_client.late_backoff_after: expected an"),
        ({"predictor_client": {"min_backoff_s": 20, "max_backoff_s": 1}},
         "predictor_client.max_backoff_s: must be at least min_backoff_s (20 s), got 1 s"),
        ({"predictor_client": {"min_backoff_s": 20}}, "predictor_client.max_backoff_s: must be at least min_backoff_s"),
        ({"output_length": {"tagger_path": 3}}, "output_length.tagger_path: expected a string"),
        ({"output_length": {"x": 1}}, "output_length: unknown key(s) ['x']; allowed: ['fixed_tokens', 'source',"),
        ({"policy": 3}, "policy: expected a string"),
        ({"policy_params": [1]}, "policy_params: expected a mapping"),
        ({"metrics_listen": "somewhere"}, "metrics_listen: expected 'host:port'"),
        ({"endpoints": None}, "endpoints: expected a list"),
        ({"endpoints": [5]}, "endpoints[0]: expected a mapping"),
        ({"endpoints": [{"address": 8000}]}, "endpoints[0].address: expected 'ip:port', got 8000"),
        ({"endpoints": [{"address": "1.2.3.4:1", "models": [""]}]}, "endpoints[0].models[0]: must not be empty"),
        ({"endpoints": [{"address": "1.2.3.4:1", "models": [3]}]}, "endpoints[0].models[0]: expected a string"),
        ({"endpoints": [{"address": "1.2.3.4:1", "predictor": "x"}]}, "endpoints[0].predictor: expected 'host:"),
        ({"decision_log_path": ""}, "decision_log_path: must not be empty"),
        ({"decision_log_path": 1}, "decision_log_path: expected a string"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_type_and_value_errors_name_the_key(extra, message):
    assert _error({**GOOD, **extra}).startswith(message), _error({**GOOD, **extra})


def test_every_error_is_reported_in_order():
    message = _error({"endpoints": [{"address": "1.2.3.4"}, {"address": "::1:80", "x": 1}], "seed": "s"})
    assert message.split("; ")[:3] == ["endpoints[0].address: expected 'ip:port', got '1.2.3.4'",
                                       "endpoints[1]: unknown key(s) ['x']",
                                       "allowed: ['address', 'models', 'predictor']"]
    assert message.endswith("seed: expected an integer, got 's'")


def test_ints_are_floats_and_nulls_are_defaults():
    config = parse_config({"endpoints": [{"address": "[0::1]:80", "models": None}], "grace_period_s": 5,
                           "health_check": None, "output_length": None, "predictor_client": None,
                           "policy_params": None})
    assert config.grace_period_s == 5.0 and isinstance(config.grace_period_s, float)
    assert config.endpoints[0].models == ()
    assert config == dataclasses.replace(parse_config({"endpoints": [{"address": "[::1]:80"}]}), grace_period_s=5.0)


def test_sections_are_the_dataclasses_other_modules_take():
    config = parse_config({**GOOD, "output_length": {"source": "fixed", "fixed_tokens": 100},
                           "predictor_client": {"predict_timeout_s": 0.05, "late_backoff_after": 3},
                           "policy_params": {"k": 3}})
    assert config.output_length == OutputLengthConfig(source="fixed", fixed_tokens=100)
    assert config.predictor_client == PredictorClientConfig(predict_timeout_s=0.05, late_backoff_after=3)
    assert type(config.policy_params) is dict and config.policy_params == {"k": 3}


@pytest.mark.parametrize(("mirror", "target"), [(OutputLengthSection, OutputLengthConfig),
                                                (PredictorClientSection, PredictorClientConfig),
                                                (TracingSection, TracingConfig)],
                         ids=["output_length", "predictor_client", "tracing"])
def test_section_mirrors_have_the_dataclass_fields_and_defaults(mirror, target):
    assert [f.name for f in dataclasses.fields(mirror)] == [f.name for f in dataclasses.fields(target)]
    assert dataclasses.asdict(mirror()) == dataclasses.asdict(target())


def test_configs_are_frozen_and_compare_by_value():
    config = parse_config(GOOD)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.policy = "random"  # type: ignore[misc]
    assert parse_config(GOOD) == config
    # What the reload watcher and the CLI flags do: replace re-validates and keeps value equality.
    assert dataclasses.replace(config, endpoints=()) == parse_config({"endpoints": []})
    assert dataclasses.replace(config, policy="random") != config
    assert dataclasses.replace(config, listen="0.0.0.0:1").listen == "0.0.0.0:1"


def test_endpoint_config_positional_and_normalised():
    assert EndpointConfig("[0:0::1]:0080", ("m",), "p:1") == EndpointConfig("[::1]:80", ("m",), "p:1")
    assert EndpointConfig("10.0.0.1:80").models == () and EndpointConfig("10.0.0.1:80").predictor is None
    with pytest.raises(ValueError, match="not an IP address"):
        EndpointConfig("localhost:80")


@pytest.mark.parametrize(("extra", "expected"), [
    ({}, ("INFO", "text")),
    ({"log_level": "warning", "log_format": "json"}, ("WARNING", "json")),
], ids=["defaults", "set"])
def test_log_keys(extra, expected):
    config = parse_config({**GOOD, **extra})
    assert (config.log_level, config.log_format) == expected


@pytest.mark.parametrize(("extra", "message"), [
    ({"log_level": "loud"}, "log_level: must be one of 'DEBUG', 'INFO', 'WARNING', 'ERROR' or 'CRITICAL', got 'loud'"),
    ({"log_level": 10}, "log_level: must be one of"),
    ({"log_format": "xml"}, "log_format: must be one of 'text' or 'json', got 'xml'"),
], ids=["level", "level-number", "format"])
def test_log_key_errors(extra, message):
    assert _error({**GOOD, **extra}).startswith(message), _error({**GOOD, **extra})


@pytest.mark.parametrize(("changes", "expected"), [
    ({}, []),
    ({"policy": "random", "drain_delay_s": 3.0}, ["policy", "drain_delay_s"]),
    ({"endpoints": ()}, ["endpoints"]),
    ({"policy_params": {"k": 3}}, ["policy_params.k"]),
    ({"predictor_client": PredictorClientConfig(predict_timeout_s=0.5, max_backoff_s=20.0)},
     ["predictor_client.predict_timeout_s", "predictor_client.max_backoff_s"]),
    ({"tokenizers": {"m": "/t.json"}, "log_format": "json"}, ["log_format", "tokenizers.m"]),
], ids=["none", "root-keys", "endpoints", "mapping-key", "section-keys", "in-field-order"])
def test_changed_keys_are_dotted_and_in_field_order(changes, expected):
    old = parse_config(GOOD)
    assert changed_keys(old, replace_config(old, **changes)) == expected
    assert LIVE_KEYS == ("endpoints",)


def test_decision_log_path():
    assert parse_config(GOOD).decision_log_path is None
    assert parse_config({**GOOD, "decision_log_path": "/var/log/decisions.jsonl"}).decision_log_path == \
        "/var/log/decisions.jsonl"


def _yaml_block(text: str, after: str) -> dict:
    """The first YAML example after the line containing ``after``: a fenced block, or an indented ``::`` one."""
    lines = text[text.index(after):].splitlines()
    if any(line.startswith("```yaml") for line in lines):
        start = next(i for i, line in enumerate(lines) if line.startswith("```yaml")) + 1
        block = lines[start:lines.index("```", start)]
    else:
        start = next(i for i, line in enumerate(lines[1:], 1) if line.strip())
        end = next((i for i, line in enumerate(lines[start:], start) if line and not line.startswith("    ")),
                   len(lines))
        block = lines[start:end]
    return yaml.safe_load("\n".join(block))


@pytest.mark.parametrize(
    "source, after",
    [(config_module.__doc__, "Example (every key"),
     ((Path(__file__).parents[2] / "README.md").read_text(), "### extproc (")],
    ids=["module-docstring", "readme"],
)
def test_documented_example_shows_every_key_with_its_default(source, after):
    example = _yaml_block(source, after)
    config = parse_config(example)
    assert dataclasses.replace(config, endpoints=()) == parse_config({"endpoints": []})
    assert set(example) == {f.name for f in dataclasses.fields(ExtprocConfig)}
    for key, cls in [("health_check", HealthCheckConfig), ("output_length", OutputLengthConfig),
                     ("predictor_client", PredictorClientConfig)]:
        assert set(example[key]) == {f.name for f in dataclasses.fields(cls)}, key


# --- JSON Schema -------------------------------------------------------------------------------------------

def _properties(schema: dict):
    yield from schema["properties"].items()
    for definition in schema.get("$defs", {}).values():
        yield from definition.get("properties", {}).items()


def test_json_schema_shape_and_descriptions():
    schema = config_json_schema()
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert "required" not in schema and schema["then"] == {"required": ["endpoints"]}
    assert schema["additionalProperties"] is False
    validator = jsonschema.Draft202012Validator(schema)
    assert not validator.is_valid({}) and validator.is_valid({"endpoints": []})
    assert validator.is_valid({"discovery": {"source": "dns", "dns_name": "vllm.default.svc"}})
    assert not validator.is_valid({"discovery": {"source": "dns"}, "endpoints": [{"address": "10.0.0.1:8000"}]})
    assert not validator.is_valid({"discovery": {"label_selector": "app=vllm"}})  # source static: endpoints needed
    assert set(schema["properties"]) == {f.name for f in dataclasses.fields(ExtprocConfig)}
    assert schema["properties"]["policy"]["enum"] == list(POLICY_NAMES)
    assert schema["properties"]["decision_log_path"]["default"] is None
    units = {"_s": "seconds", "_bytes": "bytes", "_tokens": "tokens"}
    for name, prop in _properties(schema):
        assert prop.get("description"), name
        for suffix, unit in units.items():
            if name.endswith(suffix):
                assert unit in prop["description"], name
    json.dumps(schema)  # plain JSON, for Helm's values.schema.json


def test_json_schema_accepts_the_example_and_rejects_unknown_keys():
    import jsonschema  # the test extra installs it
    example = _yaml_block(config_module.__doc__, "Example (every key")
    jsonschema.validate(example, config_json_schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**example, "polcy": "x"}, config_json_schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**example, "health_check": {"interval_s": True}}, config_json_schema())


# --- environment overrides ---------------------------------------------------------------------------------

FILE = ("policy: round-robin\npredictor_client: {predict_timeout_s: 0.03, notify_timeout_s: 0.4}\n"
        "endpoints:\n  - address: 10.0.0.1:8000\n")


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(FILE)
    return path


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, {"policy": "round-robin", "predictor_client.predict_timeout_s": 0.03}),
        ({"ASTROLABE_EXTPROC_POLICY": "least-requests"}, {"policy": "least-requests"}),
        ({"ASTROLABE_EXTPROC_PREDICTOR_CLIENT__PREDICT_TIMEOUT_S": "0.05"},
         {"predictor_client.predict_timeout_s": 0.05, "predictor_client.notify_timeout_s": 0.4}),
        ({"ASTROLABE_EXTPROC_PREDICTOR_CLIENT": "{max_backoff_s: 5}"},  # a whole section replaces the file's
         {"predictor_client.predict_timeout_s": 0.02, "predictor_client.max_backoff_s": 5.0}),
        ({"ASTROLABE_EXTPROC_PREDICTOR_CLIENT": "{predict_timeout_s: 1}",
          "ASTROLABE_EXTPROC_PREDICTOR_CLIENT__PREDICT_TIMEOUT_S": "2"},
         {"predictor_client.predict_timeout_s": 2.0}),
        ({"ASTROLABE_EXTPROC_HEALTH_CHECK__ENABLED": "false", "ASTROLABE_EXTPROC_SEED": "7"},
         {"health_check.enabled": False, "seed": 7}),
        ({"ASTROLABE_EXTPROC_LISTEN": "[::]:9002", "ASTROLABE_EXTPROC_METRICS_LISTEN": "0.0.0.0:9090"},
         {"listen": "[::]:9002", "metrics_listen": "0.0.0.0:9090"}),
        ({"ASTROLABE_EXTPROC_OUTPUT_LENGTH__TAGGER_PATH": "",
          "ASTROLABE_EXTPROC_DECISION_LOG_PATH": "/tmp/d.jsonl"},
         {"output_length.tagger_path": None, "decision_log_path": "/tmp/d.jsonl"}),
        ({"ASTROLABE_EXTPROC_ENDPOINTS": '[{"address": "10.0.0.9:80", "models": ["m"]}]'},
         {"endpoints": (EndpointConfig("10.0.0.9:80", ("m",)),)}),
        ({"ASTROLABE_EXTPROC_POLICY": "astrolabe", "ASTROLABE_EXTPROC_POLICY_PARAMS": "{k: 3}",
          "ASTROLABE_EXTPROC_POLICY_PARAMS__METRIC": "e2e"}, {"policy_params": {"k": 3, "metric": "e2e"}}),
        ({"OTHER_POLICY": "random", "ASTROLABE_EXTPROCX": "1"}, {"policy": "round-robin"}),
        ({"ASTROLABE_EXTPROC_TRACING__ENDPOINT": "10.0.0.7:4317", "ASTROLABE_EXTPROC_TRACING__SAMPLER_RATIO": "0.1"},
         {"tracing": TracingConfig(endpoint="10.0.0.7:4317", sampler_ratio=0.1)}),
        ({"ASTROLABE_EXTPROC_LOG_FORMAT": "json", "ASTROLABE_EXTPROC_LOG_LEVEL": "debug"},
         {"log_format": "json", "log_level": "DEBUG"}),
    ],
    ids=["file-only", "root", "nested", "whole-section", "nested-over-section", "bool-int", "ipv6-verbatim",
         "empty-is-null", "endpoints-json", "policy-params", "other-variables", "tracing", "logs"],
)
def test_env_overrides_win_over_the_file(config_file, environ, expected):
    config = load_config(config_file, environ)
    for dotted, value in expected.items():
        actual = config
        for part in dotted.split("."):
            actual = getattr(actual, part)
        assert actual == value and type(actual) is type(value), dotted


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"ASTROLABE_EXTPROC_POLCY": "x"}, "<root>: unknown key(s) ['polcy'] (set by ASTROLABE_EXTPROC_POLCY)"),
        ({"ASTROLABE_EXTPROC_HEALTH_CHECK__EVERY": "1"},
         "health_check: unknown key(s) ['every'] (set by ASTROLABE_EXTPROC_HEALTH_CHECK__EVERY)"),
        ({"ASTROLABE_EXTPROC_PREDICTOR_CLIENT__PREDICT_TIMEOUT_S": "fast"},
         "predictor_client.predict_timeout_s: expected a number, got 'fast' "
         "(set by ASTROLABE_EXTPROC_PREDICTOR_CLIENT__PREDICT_TIMEOUT_S)"),
        ({"ASTROLABE_EXTPROC_MAX_BODY_BYTES": "true"},
         "max_body_bytes: expected an integer, got True (set by ASTROLABE_EXTPROC_MAX_BODY_BYTES)"),
        ({"ASTROLABE_EXTPROC_ENDPOINTS": "[{address: 10.0.0.1:1}, {address: 10.0.0.1:1}]"},
         "endpoints[1].address: duplicate 10.0.0.1:1 (set by ASTROLABE_EXTPROC_ENDPOINTS)"),
        ({"ASTROLABE_EXTPROC_ENDPOINTS": "[{address: 10.0.0.1:1"},
         "endpoints: invalid YAML (set by ASTROLABE_EXTPROC_ENDPOINTS)"),
        ({"ASTROLABE_EXTPROC_POLICY": "best"}, "policy: unknown policy 'best'"),
        ({"ASTROLABE_EXTPROC_POLICY": "astrolabe", "ASTROLABE_EXTPROC_POLICY_PARAMS__K": "0"},
         "policy_params: policy 'astrolabe': k must be an integer >= 1"),
        ({"ASTROLABE_EXTPROC_LISTEN__PORT": "1"},
         "listen: not a section, cannot set 'port' (set by ASTROLABE_EXTPROC_LISTEN__PORT)"),
        ({"ASTROLABE_EXTPROC_A__B__C": "1"}, "ASTROLABE_EXTPROC_A__B__C: expected ASTROLABE_EXTPROC_<KEY> or"),
        ({"ASTROLABE_EXTPROC_PREDICTOR_CLIENT": "7"},
         "predictor_client: expected a mapping, got 7 (set by ASTROLABE_EXTPROC_PREDICTOR_CLIENT)"),
        ({"ASTROLABE_EXTPROC_TRACING__ENDPOINT": "collector"},
         "tracing.endpoint: expected host:port or an http(s):// URL, got 'collector' "
         "(set by ASTROLABE_EXTPROC_TRACING__ENDPOINT)"),
        ({"ASTROLABE_EXTPROC_TRACING__SAMPLER_RATIO": "2"},
         "tracing.sampler_ratio: must be <= 1, got 2 (set by ASTROLABE_EXTPROC_TRACING__SAMPLER_RATIO)"),
        ({"ASTROLABE_EXTPROC_TRACING__PROTOCOL": "http/json"}, "tracing.protocol: must be one of"),
    ],
    ids=["unknown-root", "unknown-nested", "nested-type", "root-type", "endpoints-duplicate", "endpoints-yaml",
         "policy", "policy-params", "not-a-section", "too-deep", "section-not-mapping", "tracing-endpoint",
         "tracing-ratio", "tracing-protocol"],
)
def test_env_override_errors_name_the_key_and_variable(config_file, environ, message):
    with pytest.raises(ConfigError) as info:
        load_config(config_file, environ)
    assert str(info.value).startswith(message), str(info.value)
    assert next(iter(environ)) in str(info.value)


def test_discovery_is_set_from_the_environment(tmp_path):
    path = tmp_path / "extproc.yaml"
    path.write_text("policy: least-requests\n")
    config = load_config(path, {"ASTROLABE_EXTPROC_DISCOVERY__SOURCE": "kubernetes",
                                "ASTROLABE_EXTPROC_DISCOVERY__INFERENCE_POOL": "vllm-pool",
                                "ASTROLABE_EXTPROC_DISCOVERY__PREDICTOR_PORT": "predictor"})
    assert (config.discovery.source, config.discovery.inference_pool, config.discovery.predictor_port) == \
        ("kubernetes", "vllm-pool", "predictor")
    assert config.endpoints == ()
    with pytest.raises(ConfigError, match="ASTROLABE_EXTPROC_DISCOVERY__SOURCE"):
        load_config(path, {"ASTROLABE_EXTPROC_DISCOVERY__SOURCE": "kubernetes"})


def test_env_overrides_default_to_os_environ(config_file, monkeypatch):
    monkeypatch.setenv(f"{ENV_PREFIX}POLICY", "least-requests")
    assert load_config(config_file).policy == "least-requests"
    assert load_config(config_file, {}).policy == "round-robin"
    assert parse_config(yaml.safe_load(FILE)).policy == "round-robin"  # parse_config never reads the environment


@pytest.mark.parametrize(
    "changes, message",
    [({"listen": "nowhere"}, "listen: expected 'host:port', got 'nowhere'"),
     ({"policy": "best"}, "policy: unknown policy 'best'"),
     ({"polcy": "x"}, "<root>: ")],
    ids=["bad-listen", "bad-policy", "unknown-key"],
)
def test_replace_config_errors(changes, message):
    with pytest.raises(ConfigError) as info:
        replace_config(parse_config(GOOD), **changes)
    assert str(info.value).startswith(message), str(info.value)


def test_replace_config_is_the_top_layer(config_file):
    config = load_config(config_file, {"ASTROLABE_EXTPROC_POLICY": "least-requests"})
    assert replace_config(config, policy="random", listen="0.0.0.0:1") == \
        dataclasses.replace(config, policy="random", listen="0.0.0.0:1")


@pytest.mark.parametrize("raw, where", [
    ({"predictor_client": {"predict_timeout_s": float("inf")}}, "predictor_client.predict_timeout_s"),
    ({"health_check": {"interval_s": float("nan")}}, "health_check.interval_s"),
    ({"policy_params": {"e2e_weight": float("nan")}}, "policy_params"),
    ({"policy_params": {"memory_s": float("inf")}}, "policy_params"),
], ids=["inf-timeout", "nan-interval", "nan-weight", "inf-memory"])
def test_non_finite_numbers_are_errors(raw, where):
    with pytest.raises(ConfigError, match=f"^{where}"):
        parse_config({"endpoints": [{"address": "10.0.0.1:80"}], **raw})


def test_a_bad_policy_parameter_from_the_environment_names_its_variable(tmp_path):
    path = tmp_path / "extproc.yaml"
    path.write_text("endpoints: [{address: 10.0.0.1:80}]\n")
    with pytest.raises(ConfigError, match=r"^policy_params: .*k must be .*\(set by ASTROLABE_EXTPROC_POLICY_PARAMS__K\)"):
        load_config(path, environ={"ASTROLABE_EXTPROC_POLICY_PARAMS__K": "0"})



@pytest.mark.parametrize("text, parsed", [("10.0.0.1", ("10.0.0.1", 53)), ("10.0.0.1:5353", ("10.0.0.1", 5353)),
                                          ("::1", ("::1", 53)), ("[::1]", ("::1", 53)), ("[0:0::1]:5353", ("::1", 5353))])
def test_nameservers_are_parsed_in_every_documented_form(text, parsed):
    """One parser for the config's check and the DNS source (they disagreed: the config refused '[::1]')."""
    from extproc.config import parse_nameserver  # noqa: PLC0415

    assert parse_nameserver(text) == parsed


@pytest.mark.parametrize("content", [b"\xff\xfe endpoints: []", b"[" * 20000, b"endpoints: " + b"[" * 20000],
                         ids=["not-utf8", "deep-list", "deep-value"])
def test_an_unreadable_or_deeply_nested_file_is_a_config_error(tmp_path, content):
    """They ended live reload for good (its watcher caught ConfigError only) and started with a traceback."""
    path = tmp_path / "extproc.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=r"not UTF-8|nested too deeply"):
        load_config(path, {})


def test_a_deeply_nested_override_is_a_config_error(tmp_path):
    path = tmp_path / "extproc.yaml"
    path.write_text("endpoints: [{address: 127.0.0.1:8000}]")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(path, {"ASTROLABE_EXTPROC_ENDPOINTS": "[" * 20000})
