"""deploy/grafana/stagediff.json and the monitoring that feeds it: every query of the dashboard (and of the KEDA
ScaledObjects of deploy/k8s/autoscaling/) reads only metrics the servers export, computed from the code
(tests/helpers/metric_names.py), so renaming a metric without its panels fails here; and
deploy/docker-compose.monitoring.yml's Prometheus scrapes every metrics port the services open, Grafana loads the
dashboard from the file the compose file mounts.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.environment_options import declared_options
from tests.helpers.k8s_manifests import K8S_DIR, MANIFEST_FILES, load
from tests.helpers.metric_names import metrics_read, unknown_metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD_FILE = DEPLOY / "grafana" / "stagediff.json"
MONITORING_OVERRIDE = DEPLOY / "docker-compose.monitoring.yml"
COMMON_SERVICES = DEPLOY / "common-services.yml"
VARIABLES = {"model", "stage", "tenant"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_FILE.read_text())


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel but rows, those inside collapsed rows included."""
    found = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            found.extend(panel.get("panels", []))
        else:
            found.append(panel)
    return found


def dashboard_problems(dashboard: dict[str, Any]) -> list[str]:
    """Each panel target or variable query that reads a metric no server exports, naming the panel and the metric."""
    problems = []
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            for name in unknown_metrics([target["expr"]]):
                problems.append(f"panel {panel['title']!r} ({target['refId']}): {name} is not exported")
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            for name in unknown_metrics([variable["definition"], variable["query"]["query"]]):
                problems.append(f"variable {variable['name']!r}: {name} is not exported")
    return problems


def test_every_query_reads_only_exported_metrics(dashboard: dict[str, Any]) -> None:
    assert not dashboard_problems(dashboard)
    read = {name for panel in _panels(dashboard) for t in panel["targets"] for name in metrics_read(t["expr"])}
    # The demand and quota metrics the dashboard exists for.
    assert {
        "stagediff_model_jobs_queued",
        "stagediff_num_requests_waiting",
        "stagediff_request_queue_time_seconds_bucket",
        "stagediff_pool_replicas_serving",
        "stagediff_pool_calls_in_flight",
        "stagediff_pool_calls_waiting",
        "stagediff_pool_queued_work_seconds",
        "stagediff_model_stage_call_latency_seconds_bucket",
        "stagediff_stage_failovers_total",
        "stagediff_stage_retries_total",
        "stagediff_requests_total",
        "stagediff_tenant_jobs",
        "stagediff_tenant_job_limit",
        "stagediff_e2e_request_latency_seconds_bucket",
    } <= read


def test_a_made_up_metric_is_named_with_its_panel(dashboard: dict[str, Any]) -> None:
    """The check fails for a panel whose query names a metric no server exports (or a counter without `_total`)."""
    broken = copy.deepcopy(dashboard)
    panel = _panels(broken)[3]
    panel["targets"].append({"refId": "Z", "expr": 'sum(rate(stagediff_jobs_rejected_total{model=~"$model"}[5m]))'})
    panel["targets"].append({"refId": "Y", "expr": "sum(stagediff_stage_retries)"})
    assert dashboard_problems(broken) == [
        f"panel {panel['title']!r} (Z): stagediff_jobs_rejected_total is not exported",
        f"panel {panel['title']!r} (Y): stagediff_stage_retries is not exported",
    ]


def test_metric_names_are_read_outside_strings_only() -> None:
    expression = (
        'sum by (le) (rate(stagediff_e2e_request_latency_seconds_bucket{job="stagediff_jobs", model=~"stagediff_.*"}'
        "[$__rate_interval])) / stagediff_num_requests_running"
    )
    read = metrics_read(expression)
    assert read == {"stagediff_e2e_request_latency_seconds_bucket", "stagediff_num_requests_running"}


def test_the_keda_scalers_read_only_exported_metrics() -> None:
    """Every ScaledObject shipped (deploy/k8s/autoscaling/), by the same check as the panels."""
    queries = {
        f"{path.relative_to(K8S_DIR)}: {doc['metadata']['name']}": trigger["metadata"]["query"]
        for path in MANIFEST_FILES
        for doc in load(path)
        if doc["kind"] == "ScaledObject"
        for trigger in doc["spec"]["triggers"]
    }
    assert len(queries) >= 6
    for where, query in queries.items():
        assert metrics_read(query), where
        assert not unknown_metrics([query]), f"{where}: {unknown_metrics([query])} are not exported"


def _balanced(expression: str) -> bool:
    depth = []
    pairs = {")": "(", "]": "[", "}": "{"}
    for char in re.sub(r'"(?:[^"\\]|\\.)*"', '""', expression):
        if char in "([{":
            depth.append(char)
        elif char in pairs and (not depth or depth.pop() != pairs[char]):
            return False
    return not depth


def test_queries_are_well_formed(dashboard: dict[str, Any]) -> None:
    """Balanced brackets; a quantile over a histogram's buckets aggregated by `le`; a rate over counters only; the
    variables a selector uses exist."""
    for panel in _panels(dashboard):
        for target in panel["targets"]:
            expr = target["expr"]
            where = f"{panel['title']} ({target['refId']})"
            assert _balanced(expr), where
            for argument in re.findall(r"histogram_quantile\(\s*[0-9.]+\s*,\s*sum by \(([^)]*)\)\s*\(rate\(", expr):
                assert "le" in [label.strip() for label in argument.split(",")], where
            assert expr.count("histogram_quantile(") == len(re.findall(r"histogram_quantile\(.*?_bucket\{", expr))
            for counted in re.findall(r"rate\((stagediff_\w+)", expr):
                assert counted.endswith(("_total", "_bucket", "_count", "_sum")), f"{where}: rate() of {counted}"
            assert set(re.findall(r"\$(\w+)", expr)) <= VARIABLES | {"__rate_interval"}, where


def test_dashboard_shape(dashboard: dict[str, Any]) -> None:
    """A templated Prometheus data source used by every panel and query; model, stage and tenant variables from
    label_values of exported metrics, each used by some panel; unique ids; panels on the 24-column grid, not
    overlapping."""
    assert dashboard["schemaVersion"] >= 39 and dashboard["uid"] == "stagediff"
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert set(variables) == {"datasource", *VARIABLES}
    used = set()
    for name in VARIABLES:
        variable = variables[name]
        assert variable["datasource"] == DATASOURCE, name
        assert re.fullmatch(rf"label_values\(stagediff_\w+, {name}\)", variable["definition"]), name
        assert variable["query"]["query"] == variable["definition"] and variable["includeAll"], name
    panels = _panels(dashboard)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= GRID_WIDTH, panel["title"]
        columns, rows = range(grid["x"], grid["x"] + grid["w"]), range(grid["y"], grid["y"] + grid["h"])
        mine = {(x, y) for x in columns for y in rows}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
    for panel in panels:
        assert panel["datasource"] == DATASOURCE and panel["targets"], panel["title"]
        assert panel.get("description"), f"{panel['title']}: say what it shows"
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            used |= set(re.findall(r"\$(\w+)", target["expr"]))
    assert used >= VARIABLES


# ------------------------------------------------------------------------------------------- compose monitoring --


def _override() -> dict[str, Any]:
    return yaml.safe_load(MONITORING_OVERRIDE.read_text())["services"]


def _container_port(publish: str) -> int:
    return int(publish.rsplit(":", 1)[1])


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path (relative to deploy/) of each bind mount."""
    mounts = {}
    for volume in service.get("volumes", []):
        host, container, *_ = volume.split(":")
        if host.startswith("./"):
            mounts[container] = host
    return mounts


def test_prometheus_scrapes_every_metrics_port() -> None:
    """The orchestrator's --metrics-port (common-services.yml) and each stage's, which the override turns on through
    STAGEDIFF_METRICS_PORT (an option every stage declares); nothing else."""
    services = yaml.safe_load(COMMON_SERVICES.read_text())["services"]
    override = _override()
    expected = set()
    orchestrator = services["orchestrator"]["command"]
    expected.add(f"orchestrator:{orchestrator[orchestrator.index('--metrics-port') + 1]}")
    for name, body in override.items():
        port = (body.get("environment") or {}).get("STAGEDIFF_METRICS_PORT")
        if port is None:
            continue
        stage = services[name]["command"][1]
        assert "STAGEDIFF_METRICS_PORT" in {d.variable for d in declared_options(stage).values()}, stage
        assert str(port) != orchestrator[orchestrator.index("--metrics-port") + 1]
        expected.add(f"{name}:{port}")
    assert {"text-encoder", "dit", "vae", "interp"} <= {target.partition(":")[0] for target in expected}
    prometheus = override["prometheus"]
    config_file = next(arg for arg in prometheus["command"] if arg.startswith("--config.file=")).partition("=")[2]
    config = yaml.safe_load((DEPLOY / _mounts(prometheus)[config_file]).read_text())
    targets = {
        target for job in config["scrape_configs"] for static in job["static_configs"] for target in static["targets"]
    }
    assert targets == expected


def test_grafana_provisions_the_prometheus_and_the_dashboard() -> None:
    """The data source is the override's Prometheus on its container port; the dashboard provider reads the folder
    the override mounts stagediff.json into, which is also the home dashboard."""
    override = _override()
    grafana = override["grafana"]
    mounts = _mounts(grafana)
    provisioning = DEPLOY / mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"]
    prometheus_port = {_container_port(p) for p in override["prometheus"]["ports"]}
    assert re.fullmatch(r"http://prometheus:(\d+)", source["url"])
    assert int(source["url"].rsplit(":", 1)[1]) in prometheus_port
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "stagediff.yml").read_text())["providers"]
    (dashboard_path,) = [path for path, host in mounts.items() if (DEPLOY / host).resolve() == DASHBOARD_FILE]
    assert Path(dashboard_path).parent == Path(provider["options"]["path"])
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dashboard_path
    assert grafana["depends_on"] == {"prometheus": {"condition": "service_healthy"}}


def test_monitoring_images_are_pinned_and_published_on_loopback_only() -> None:
    for name in ("prometheus", "grafana"):
        service = _override()[name]
        image, _, tag = service["image"].partition(":")
        assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{name}: pin a version, not {tag or 'latest'}"
        for publish in service["ports"]:
            assert publish.startswith("127.0.0.1:"), f"{name}: {publish} reaches beyond this host"


def test_the_kubernetes_prometheus_is_pinned_to_the_same_release() -> None:
    """deploy/k8s/autoscaling's Prometheus runs the release the compose override runs."""
    docs = load(K8S_DIR / "autoscaling" / "pools" / "prometheus.yaml")
    (deployment,) = [doc for doc in docs if doc["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == _override()["prometheus"]["image"]
