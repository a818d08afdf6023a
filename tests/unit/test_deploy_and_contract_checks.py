"""Static checks of what ships beside the code: the proto contract (buf lint, and buf
breaking against the last release tag), the Dockerfile (hadolint), the compose file and
Kubernetes manifests (yamllint, kubernetes-validate against the Kubernetes schemas)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BIN = pathlib.Path(sys.executable).parent
BUF = ["npx", "--yes", "@bufbuild/buf@1.50.0"]


def _run(cmd: list[str], cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_buf_lint() -> None:
    if shutil.which("npx") is None:
        pytest.fail("npx (Node.js) is needed for buf lint")
    proc = _run([*BUF, "lint"], cwd=ROOT / "proto")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_buf_breaking_against_the_last_release() -> None:
    tags = _run(["git", "tag", "--list", "v*", "--sort=-v:refname"]).stdout.split()
    if not tags:
        pytest.skip("no release tag yet: nothing to be compatible with")
    proc = _run([*BUF, "breaking", "--against", f"{ROOT}/.git#tag={tags[0]},subdir=proto"], cwd=ROOT / "proto")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_passes_hadolint() -> None:
    proc = _run([str(BIN / "hadolint"), "deploy/Dockerfile"])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_runs_as_non_root_with_a_grpc_health_check() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    final = text.split("\nFROM ")[-1]
    assert "USER 10001" in final and "HEALTHCHECK" in final and '"hookwire", "health"' in final
    assert "gcc" not in final and "build-essential" not in final


def test_yaml_passes_yamllint() -> None:
    proc = _run([str(BIN / "yamllint"), "-c", "deploy/.yamllint.yaml", "deploy"])
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("manifest", ["configmap.yaml", "deployment.yaml", "service.yaml", "secret.example.yaml",
                                      "harvest-pvc.yaml", "harvest-job.yaml"])
def test_kubernetes_manifests_validate_against_the_schemas(manifest: str) -> None:
    proc = _run([str(BIN / "kubernetes-validate"), "--strict", f"deploy/k8s/{manifest}"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "passed" in proc.stdout + proc.stderr


def test_manifests_fit_together() -> None:
    deployment = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["readinessProbe"]["grpc"]["port"] == 50051
    assert container["livenessProbe"]["grpc"]["port"] == 50051
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert pod["volumes"][0]["configMap"]["name"] == "hookwire-config"
    assert pod["volumes"][1]["secret"]["secretName"] == "hookwire-tokens"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert pod["enableServiceLinks"] is False and env["HOOKWIRE_PORT"] == "50051"  # no tcp://... from the Service
    assert env["HOOKWIRE_TOKENS_FILE"].startswith("/etc/hookwire/secrets/")  # no unauthenticated pods
    secret = yaml.safe_load((DEPLOY / "k8s" / "secret.example.yaml").read_text())
    from hookwire_server.auth import parse_lines

    assert parse_lines(secret["stringData"]["tokens.txt"], "secret")[0].principal.role == "user"
    services = list(yaml.safe_load_all((DEPLOY / "k8s" / "service.yaml").read_text()))
    assert [s["spec"].get("clusterIP") for s in services] == [None, "None"]  # regular + headless
    labels = deployment["spec"]["selector"]["matchLabels"]
    assert all(s["spec"]["selector"] == labels for s in services)
    # Harvest storage survives pods and is shared by the replicas and the harvest Job.
    pvc = yaml.safe_load((DEPLOY / "k8s" / "harvest-pvc.yaml").read_text())
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["harvest"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert env["HOOKWIRE_HARVEST_OUTPUT_ROOT"].startswith(mounts["harvest"])
    assert env["HOOKWIRE_HARVEST_DATA_ROOT"].startswith(mounts["harvest"])
    job = yaml.safe_load((DEPLOY / "k8s" / "harvest-job.yaml").read_text())
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    command = " ".join(spec["template"]["spec"]["containers"][0]["args"])
    assert f"--num-workers {spec['completions']}" in command and '"$JOB_COMPLETION_INDEX"' in command
    assert f"--target {services[0]['metadata']['name']}:50051" in command
    from hookwire._cli import build_parser

    argv = command.split("exec hookwire ", 1)[1].replace("'", "").replace('"$JOB_COMPLETION_INDEX"', "1").split()
    parsed = build_parser().parse_args(argv)  # the CLI accepts the Job's command line
    assert parsed.worker_index == 1 and parsed.num_workers == spec["completions"]


def test_configmap_and_compose_config_are_the_same_and_load() -> None:
    configmap = yaml.safe_load((DEPLOY / "k8s" / "configmap.yaml").read_text())
    in_cluster = configmap["data"]["hookwire.toml"]
    assert in_cluster.strip() == "\n".join(
        line for line in (DEPLOY / "hookwire.toml").read_text().splitlines() if not line.startswith("#")
    ).strip()
    from hookwire_server.api.config import resolve_settings
    from hookwire_server.models.model_loading import load_config_file

    server, models = load_config_file(DEPLOY / "hookwire.toml")
    settings, sources = resolve_settings({}, {}, server)
    assert settings.grace == 20.0 and sources["grace"] == "config"
    assert [m.name for m in models] == ["mlp", "tiny-transformer"]
    assert tomllib.loads(in_cluster)["models"][0]["factory"] == "hookwire_server.demo_models:mlp"
