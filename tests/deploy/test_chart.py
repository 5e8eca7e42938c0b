"""The Helm chart through the real Helm engine: lint, render, security defaults and refusals."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from kvrelay.proxy.config import Settings
from tests.deploy.conftest import CHART, Helm

HA_VALUES = CHART / "ci" / "ha-values.yaml"
SECRET_FIELDS = ("api_keys", "admin_key", "connector_secret", "metrics_key")


def _values() -> dict[str, Any]:
    return dict(yaml.safe_load((CHART / "values.yaml").read_text()))


def _errors(lint: dict[str, Any]) -> list[dict[str, Any]]:
    # Helm severities: 1 info, 2 warning, 3 error.
    return [m for m in lint["messages"] if m["severity"] >= 2]


def test_lint_default_values(helm: Helm) -> None:
    lint = helm.lint()
    assert lint["errors"] == 0 and _errors(lint) == [], lint


def test_lint_ha_values_redis_autoscaling_servicemonitor(helm: Helm) -> None:
    lint = helm.lint([HA_VALUES])
    assert lint["errors"] == 0 and _errors(lint) == [], lint


def test_lint_reports_invalid_values(helm: Helm) -> None:
    lint = helm.lint(set_values={"replicaCount": 3})
    assert lint["errors"] > 0 and any(m["path"] == "values.yaml" for m in _errors(lint))


def test_default_render_is_one_hardened_proxy(helm: Helm) -> None:
    out = helm.render()
    kinds = sorted(m["kind"] for m in out.manifests)
    assert kinds == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "ServiceAccount"]
    deployment = out.one("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 1
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    container = out.proxy_container()
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["args"] == ["serve"]
    # The one writable path is /tmp (scratch, and the metrics multiprocess files), an emptyDir.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert set(mounts) == {"/tmp"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/tmp"]]["emptyDir"] == {"sizeLimit": "128Mi"}
    # No secret is ever rendered by default, and nothing references one.
    assert out.all("Secret") == []
    assert "env" not in container


def test_probes_hit_health_and_ready_on_the_proxy_port(helm: Helm) -> None:
    container = helm.render().proxy_container()
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    moved = helm.render(set_values={"config": {"port": 9100}}).proxy_container()
    assert moved["ports"][0]["containerPort"] == 9100


def test_grace_period_outlasts_the_longest_stream(helm: Helm) -> None:
    total = _values()["config"]["total_timeout"]
    pod = helm.render().one("Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > total
    longer = helm.render(set_values={"config": {"total_timeout": 1800.0}})
    grace = longer.one("Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > 1800
    error = helm.refusal({"terminationGracePeriodSeconds": 30})
    assert "terminationGracePeriodSeconds (30) must exceed config.total_timeout" in error


def test_secret_settings_come_from_existing_secrets_only(helm: Helm) -> None:
    out = helm.render(
        set_values={
            "secrets": {
                "api_keys": {"existingSecret": "keys"},
                "connector_secret": {"existingSecret": "hmac", "key": "secret"},
            }
        }
    )
    env = {e["name"]: e for e in out.proxy_container()["env"]}
    assert env["KVRELAY_API_KEYS"]["valueFrom"]["secretKeyRef"] == {
        "name": "keys",
        "key": "api-keys",
    }
    assert env["KVRELAY_CONNECTOR_SECRET"]["valueFrom"]["secretKeyRef"] == {
        "name": "hmac",
        "key": "secret",
    }
    assert "KVRELAY_ADMIN_KEY" not in env
    assert all("value" not in e for e in env.values())
    assert out.all("Secret") == []
    configmap = out.one("ConfigMap")["data"]
    assert not any(name in configmap for name in env)
    # A secret put into plain config is refused by the schema and by the template.
    assert "admin_key" in helm.refusal({"config": {"admin_key": "hunter2"}})
    error = helm.refusal({"config": {"admin_key": "hunter2"}}, skip_schema=True)
    assert "admin_key is a secret: set secrets.admin_key.existingSecret" in error


def test_several_replicas_without_redis_are_refused(helm: Helm) -> None:
    for bad in (
        {"replicaCount": 2},
        {"autoscaling": {"enabled": True}},
        {"config": {"workers": 4}},
    ):
        # The schema refuses it ...
        assert "values don't meet the specifications of the schema" in helm.refusal(bad), bad
        # ... and so does the template, for installs that skip the schema.
        error = helm.refusal(bad, skip_schema=True)
        assert "needs the shared Redis conversation map" in error, (bad, error)
    for shared in (
        {"redis": {"enabled": True}},
        {"config": {"map_url": "redis://redis.example:6379/0"}},
        {"redis": {"existingSecret": "redis-url"}},
    ):
        out = helm.render(set_values={"replicaCount": 3, **shared})
        assert out.one("Deployment")["spec"]["replicas"] == 3


def test_schema_refuses_unknown_and_malformed_settings(helm: Helm) -> None:
    assert "schema" in helm.refusal({"config": {"first_byte_timout": 5}})
    assert "schema" in helm.refusal({"config": {"prefill": ["p0:8000"]}})
    assert "schema" in helm.refusal({"config": {"map_url": "postgres://x"}})
    assert "schema" in helm.refusal({"replicaCount": 0})


def test_ha_values_render_redis_hpa_pdb_servicemonitor_networkpolicy(helm: Helm) -> None:
    out = helm.render([HA_VALUES])
    deployment = out.one("Deployment")
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    hpa = out.one("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    pdb = out.one("PodDisruptionBudget")
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    redis = out.one("Deployment", "rel-kvrelay-redis")
    redis_sc = redis["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert redis_sc["readOnlyRootFilesystem"] is True and redis_sc["capabilities"]["drop"] == [
        "ALL"
    ]
    assert redis["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    out.one("Service", "rel-kvrelay-redis")
    env = {e["name"]: e for e in out.proxy_container()["env"]}
    assert env["KVRELAY_MAP_URL"]["value"] == "redis://rel-kvrelay-redis:6379/0"
    # The proxy makes a fresh multiprocess directory under /tmp itself at every start.
    assert "PROMETHEUS_MULTIPROC_DIR" not in env
    monitor = out.one("ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["spec"]["selector"]["matchLabels"] == out.one("Service")["spec"]["selector"]
    policies = {p["metadata"]["name"]: p["spec"] for p in out.all("NetworkPolicy")}
    redis_from = policies["rel-kvrelay-redis"]["ingress"][0]["from"][0]["podSelector"]
    assert redis_from["matchLabels"] == selector
    assert policies["rel-kvrelay"]["podSelector"]["matchLabels"] == selector


def test_metrics_key_reaches_the_proxy_and_the_service_monitor(helm: Helm) -> None:
    out = helm.render(
        [HA_VALUES], set_values={"secrets": {"metrics_key": {"existingSecret": "scrape"}}}
    )
    env = {e["name"]: e for e in out.proxy_container()["env"]}
    assert env["KVRELAY_METRICS_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "scrape",
        "key": "metrics-key",
    }
    endpoint = out.one("ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "scrape", "key": "metrics-key"},
    }
    assert (
        "authorization"
        not in helm.render([HA_VALUES]).one("ServiceMonitor")["spec"]["endpoints"][0]
    )


def test_otel_values_become_the_standard_variables(helm: Helm) -> None:
    assert "env" not in helm.render().proxy_container()  # nothing set: tracing stays off
    otel = {"endpoint": "http://collector.obs:4318", "serviceName": "kvrelay-eu"}
    env = {e["name"]: e for e in helm.render(set_values={"otel": otel}).proxy_container()["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://collector.obs:4318"
    assert env["OTEL_SERVICE_NAME"]["value"] == "kvrelay-eu"
    assert "schema" in helm.refusal({"otel": {"endpoint": "collector:4318"}})  # not a URL
    assert "schema" in helm.refusal({"config": {"tracing": "yes"}})


def test_dashboard_configmap_is_labelled_for_the_grafana_sidecar(helm: Helm) -> None:
    assert helm.render().all("ConfigMap")[0]["metadata"]["name"] == "rel-kvrelay"
    out = helm.render(set_values={"dashboard": {"enabled": True}})
    dashboard = out.one("ConfigMap", "rel-kvrelay-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "dashboards" / "kvrelay.json").read_text())
    assert json.loads(dashboard["data"]["kvrelay.json"]) == shipped


def test_notes_warn_about_missing_fleet_and_connector_secret(helm: Helm) -> None:
    notes = helm.render().notes
    assert "config.prefill and/or config.decode are empty" in notes
    assert "secrets.connector_secret.existingSecret is empty" in notes
    quiet = helm.render([HA_VALUES]).notes
    assert "WARNING" not in quiet and "in-chart Redis" in quiet


def test_kubernetes_discovery_adds_a_least_privilege_role(helm: Helm) -> None:
    assert not helm.render().all("Role")
    out = helm.render(
        set_values={
            "redis": {"enabled": True},
            "config": {"decode_selector": "app=vllm-d", "prefill_selector": "app=vllm-p",
                       "kube_namespace": "llm"},
        }
    )  # fmt: skip
    role = out.one("Role", "rel-kvrelay-discovery")
    assert role["metadata"]["namespace"] == "llm"
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["list", "watch"]}]  # fmt: skip
    binding = out.one("RoleBinding", "rel-kvrelay-discovery")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    account = out.one("ServiceAccount")["metadata"]["name"]
    assert binding["subjects"][0]["name"] == account
    pod = out.one("Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account and pod["automountServiceAccountToken"] is True
    assert out.one("ConfigMap")["data"]["KVRELAY_DECODE_SELECTOR"] == "app=vllm-d"
    assert "config.prefill and/or config.decode are empty" not in out.notes


def test_values_cover_every_proxy_setting_with_its_default() -> None:
    values = _values()
    secret = {name for name, f in Settings.model_fields.items() if "SecretStr" in str(f.annotation)}
    assert secret == set(SECRET_FIELDS) == set(values["secrets"])
    plain = {n: f for n, f in Settings.model_fields.items() if n not in secret}
    assert set(values["config"]) == set(plain)
    defaults = Settings.model_construct().model_dump(mode="json")
    for name in plain:
        assert values["config"][name] == defaults[name], name
    schema = json.loads((CHART / "values.schema.json").read_text())
    described = set(schema["properties"]["config"]["properties"])
    assert described == set(Settings.model_fields), "values.schema.json config drifted"


def test_rendered_configmap_is_read_back_by_the_settings_model(
    helm: Helm, monkeypatch: pytest.MonkeyPatch
) -> None:
    chosen = {
        "prefill": ["http://p0:8000", "http://p1:8000"],
        "decode": ["http://d0:8000"],
        "side_channels": {"http://d0:8000": "d0:5600"},
        "map_url": "redis://redis:6379/2",
        "workers": 3,
        "total_timeout": 900.5,
        "body_limit_bytes": 16777216,
        "stock_vllm_reuse": True,
        "log_level": "DEBUG",
        "tenant_rps": 2.5,
        "tenant_limits": {"t" + "0" * 24: "inflight=4;rps=1"},
        "passthrough_routes": ["/v1/embeddings", "/v1/rerank"],
        "log_format": "json",
        "tracing": "on",
    }
    out = helm.render(set_values={"config": chosen})
    for key in list(os.environ):
        if key.startswith("KVRELAY_"):
            monkeypatch.delenv(key)
    for key, value in out.one("ConfigMap")["data"].items():
        monkeypatch.setenv(key, value)
    settings = Settings(_env_file=None)
    loaded = settings.model_dump(mode="json")
    for name, value in chosen.items():
        assert loaded[name] == value, name
    settings.check_runnable()


def test_manifests_are_checked_against_the_kubernetes_api_schemas(helm: Helm) -> None:
    # Every render above is validated (Helm.render); this shows the check bites on a typo
    # that Helm itself and the chart's schema (free-form podSecurityContext) let through.
    out = helm.install(set_values={"podSecurityContext": {"runAsUsr": 1000}})
    assert out["ok"]
    assert any("'runAsUsr' was unexpected" in finding for finding in out["invalid"])
