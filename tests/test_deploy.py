"""deploy/: every config parses, all name one image, one package and one Ray, and each matches the
code it runs (the CLI's flags, actors/metrics.py's metrics, Ray's cluster-config schema).

Offline and fast: no Docker, no Kubernetes, no cluster; one subprocess (`specter batch --help`).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from actors.metrics import ALL_METRICS as METRICS

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUBERAY = ("kuberay/raycluster.yaml", "kuberay/rayjob.yaml")
DISCOVERY_FILE = "/tmp/ray/prom_metrics_service_discovery.json"


def _project() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _load(name: str) -> Any:
    path = DEPLOY / name
    return json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())


def _walk(value: Any, key: str) -> Iterator[Any]:
    """Every value stored under ``key`` anywhere in a parsed document."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k == key:
                yield v
            yield from _walk(v, key)
    elif isinstance(value, list):
        for item in value:
            yield from _walk(item, key)


def _cluster_spec(name: str) -> dict[str, Any]:
    doc = _load(name)
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def _entrypoint() -> list[str]:
    return shlex.split(_load("kuberay/rayjob.yaml")["spec"]["entrypoint"])


def _dockerfile() -> str:
    return (DEPLOY / "Dockerfile").read_text()


def test_every_yaml_and_json_in_deploy_parses():
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in {".yaml", ".yml", ".json"})
    names = {str(p.relative_to(DEPLOY)) for p in files}
    assert {"ray-cluster.yaml", "runtime_env.yaml", "prometheus.yml", "grafana/specter.json", *KUBERAY} <= names
    for path in files:
        text = path.read_text()
        docs = [json.loads(text)] if path.suffix == ".json" else list(yaml.safe_load_all(text))
        assert docs and all(isinstance(d, dict) and d for d in docs), f"{path}: expected non-empty mappings"


def test_one_image_everywhere_named_after_the_package():
    project = _project()
    tag = f"{project['name']}:{project['version']}"
    built = re.findall(r"docker build -f deploy/Dockerfile -t (\S+) \.", _dockerfile())
    assert built == [tag], "the Dockerfile's build line tags the image <package>:<version>"
    used = {_load("ray-cluster.yaml")["docker"]["image"]}
    for name in KUBERAY:
        used |= set(_walk(_load(name), "image"))
    assert used == {tag}
    mentioned = {m for p in DEPLOY.rglob("*") if p.is_file() for m in re.findall(r"specter-moe:[\w.-]+", p.read_text())}
    assert mentioned == {tag}, "every mention of the image in deploy/ names the same tag"


def test_dockerfile_installs_this_package_on_the_clusters_ray():
    project, text = _project(), _dockerfile()
    assert f'org.opencontainers.image.title="{project["name"]}"' in text
    assert f'org.opencontainers.image.version="{project["version"]}"' in text
    assert re.search(r"^RUN pip install [^\n]*\s\.\s", text, re.M), "pip install of the repository's package"
    for line in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", text, re.M):
        for source in line.split():
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    ray_version = re.search(r"^ARG RAY_VERSION=(\S+)$", text, re.M).group(1)
    assert re.search(r"^FROM rayproject/ray:\$\{RAY_VERSION\}-py3\d+-gpu$", text, re.M)
    assert {_cluster_spec(name)["rayVersion"] for name in KUBERAY} == {ray_version}


def test_runtime_env_ships_this_package():
    project = _project()
    env = _load("runtime_env.yaml")
    assert set(env) <= {"working_dir", "py_modules", "pip", "excludes", "env_vars", "config"}
    assert all(isinstance(v, str) for v in env["env_vars"].values()), "Ray needs string env values"
    assert env["env_vars"]["OMP_NUM_THREADS"].isdigit()
    if "working_dir" in env:  # relative to the repository root, where `ray job submit` runs
        shipped = tomllib.loads((ROOT / env["working_dir"] / "pyproject.toml").read_text())["project"]
        assert shipped["name"] == project["name"]
    wheel = project["name"].replace("-", "_")
    for name, version in re.findall(r"(specter[-_]moe)-(\d[\w.]*?)-py3", (DEPLOY / "runtime_env.yaml").read_text()):
        assert (name, version) == (wheel, project["version"])
    assert "working_dir" in env or any(wheel in m for m in env.get("py_modules", []))


def test_ray_cluster_config_is_valid_with_a_loopback_dashboard_and_metrics_port():
    from ray.autoscaler._private.util import validate_config

    config = _load("ray-cluster.yaml")
    validate_config(config)  # Ray's own schema (ray-schema.json)
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "--metrics-export-port=8080" in head
    assert "--dashboard-host=0.0.0.0" in (DEPLOY / "ray-cluster.yaml").read_text(), "the commented way to expose it"
    workers = [t for n, t in config["available_node_types"].items() if n != config["head_node_type"]]
    assert workers and all(t["resources"].get("GPU") == 1 for t in workers)
    assert config["available_node_types"][config["head_node_type"]]["resources"].get("CPU") == 0


@pytest.mark.parametrize("name", KUBERAY)
def test_kuberay_cluster_has_gpu_workers_and_a_head_without_actors(name):
    doc = _load(name)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] in {"RayCluster", "RayJob"}
    spec = _cluster_spec(name)
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    for group in spec["workerGroupSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert "/dev/shm" in {m["mountPath"] for m in container["volumeMounts"]}, "the slot pool needs /dev/shm"
    for params in [spec["headGroupSpec"]["rayStartParams"]] + [g["rayStartParams"] for g in spec["workerGroupSpecs"]]:
        assert params["metrics-export-port"] == "8080"


@pytest.fixture(scope="module")
def batch_help() -> str:
    proc = subprocess.run([sys.executable, "-m", "specter.cli", "batch", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"`specter batch --help` failed: {proc.stderr[-1000:]}"
    return proc.stdout


def test_rayjob_entrypoint_is_a_batch_the_cli_accepts(batch_help):
    args = _entrypoint()
    assert args[:2] == ["specter", "batch"] and args[2] == "/data/prompts.jsonl"
    flags = {f: args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
             for i, f in enumerate(args) if f.startswith("--")}
    accepted = set(re.findall(r"(--[a-z][a-z0-9-]*)", batch_help))
    assert set(flags) <= accepted, f"flags `specter batch` does not accept: {set(flags) - accepted}"
    for flag, choices in re.findall(r"(--[a-z][a-z0-9-]*) \{([^}]*)\}", batch_help):
        if flag in flags:
            assert flags[flag] in choices.split(","), f"{flag} {flags[flag]}: not one of {{{choices}}}"
    assert flags["--out"] == "/data/results.jsonl" and flags["--address"] == "auto"
    gpu_pods = sum(g["replicas"] for g in _cluster_spec("kuberay/rayjob.yaml")["workerGroupSpecs"])
    assert 1 <= int(flags["--replicas"]) <= gpu_pods, "one replica per GPU pod"


def _grafana_names() -> set[str]:
    board = _load("grafana/specter.json")
    exprs = list(_walk(board["panels"], "expr")) + [v["query"]["query"] for v in board["templating"]["list"]
                                                    if isinstance(v.get("query"), dict)]
    assert exprs
    return {name for expr in exprs for name in re.findall(r"\bray_specter_\w+", expr)}


def _prometheus_names(metric) -> set[str]:
    if metric.kind == "histogram":
        return {f"{metric.prometheus}_{suffix}" for suffix in ("bucket", "sum", "count")}
    return {metric.prometheus}


def test_grafana_uses_exactly_the_metrics_specter_exports():
    used = _grafana_names()
    exported = {metric.name: _prometheus_names(metric) for metric in METRICS}
    unknown = used - set().union(*exported.values())
    assert not unknown, f"not in actors.metrics.METRICS (or with the wrong suffix): {sorted(unknown)}"
    unshown = [name for name, names in exported.items() if not names & used]
    assert not unshown, f"metrics no panel shows: {unshown}"


def test_grafana_dashboard_is_well_formed():
    board = _load("grafana/specter.json")
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        for target in panel.get("targets", []):
            assert target["expr"].count("(") == target["expr"].count(")"), panel["title"]
    tpot = " ".join(_walk([p for p in panels if "TPOT" in p["title"]], "expr"))
    assert "histogram_quantile(0.5," in tpot and "histogram_quantile(0.95," in tpot and "by (replica, le)" in tpot
    job = next(v for v in board["templating"]["list"] if v["name"] == "job")
    assert job["current"]["value"] in {j["job_name"] for j in _load("prometheus.yml")["scrape_configs"]}


def test_prometheus_scrapes_rays_service_discovery_file_and_a_loopback_example():
    jobs = _load("prometheus.yml")["scrape_configs"]
    discovered = [j for j in jobs if any(DISCOVERY_FILE in sd["files"] for sd in j.get("file_sd_configs", []))]
    assert discovered, f"no job reads {DISCOVERY_FILE}"
    static = [t for j in jobs for sc in j.get("static_configs", []) for t in sc["targets"]]
    assert "127.0.0.1:8080" in static


def test_dashboard_screenshot_script_reads_its_command_line_and_the_state_api():
    spec = importlib.util.spec_from_file_location("dashboard_screenshot", ROOT / "scripts" / "dashboard_screenshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args(["--port", "8300", "--", "specter", "batch", "p.jsonl", "--out", "r.jsonl"])
    assert args.port == 8300 and args.command == ["specter", "batch", "p.jsonl", "--out", "r.jsonl"]
    payload = {"result": True, "data": {"result": {"total": 1, "result": [{"name": "specter-a-draft", "state": "ALIVE"}]}}}
    assert module._rows(payload) == [{"name": "specter-a-draft", "state": "ALIVE"}]


def test_every_cluster_runs_with_token_authentication():
    launcher = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = " ".join(launcher[key])
        assert "export RAY_AUTH_MODE=token" in start and start.index("RAY_AUTH_MODE") < start.index("ray start")
    assert launcher["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    cluster = yaml.safe_load((DEPLOY / "kuberay" / "raycluster.yaml").read_text())
    job = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    for spec in (cluster["spec"], job["spec"]["rayClusterSpec"]):
        assert spec["authOptions"] == {"mode": "token"}
        assert tuple(map(int, spec["rayVersion"].split("."))) >= (2, 52, 0)
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            assert "RAY_AUTH_MODE=disabled" not in path.read_text(errors="replace"), path


def test_the_project_never_turns_ray_authentication_off():
    pattern = re.compile(r"RAY_AUTH_MODE\W{0,4}disabled")
    paths = [ROOT / "README.md", *(p for d in ("specter", "actors", "scripts", "deploy", "docs")
                                   for p in (ROOT / d).rglob("*") if p.suffix in {".py", ".sh", ".yaml", ".yml", ".md"})]
    offenders = [str(p.relative_to(ROOT)) for p in paths if p.is_file() and pattern.search(p.read_text(errors="replace"))]
    assert offenders == []
