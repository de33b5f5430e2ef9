"""deploy/: the Serve config validates against Ray's own schema and builds with our
application builder; the RayService embeds it verbatim and asks for the TPU host it fits.

The RayService itself is a KubeRay custom resource, but its core Kubernetes fields are
Kubernetes types: its metadata is an ObjectMeta and every head / worker group ``template`` is
a PodTemplateSpec. Those are validated against Kubernetes' own OpenAPI schemas (strict: an
unknown or misspelt field fails), shipped offline by ``kubernetes-validate``; the rest is
checked structurally (nodeSelector, TPU requests = limits = the app's chips, hosts per slice
= the topology's chips / 4, Ray version = the pinned one).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("ray.serve")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PYPROJECT = DEPLOY.parent / "pyproject.toml"
CHIPS_PER_HOST = 4  # Ironwood VM


# Each RayService embeds one Serve config; the 2x2x2 one spans two hosts per engine replica.
SERVE_CONFIGS = {"rayservice-tpu7x-2x2x1.yaml": "serve_config.yaml",
                 "rayservice-tpu7x-2x2x2.yaml": "serve_config_2x2x2.yaml"}


def _serve_config(name: str = "serve_config.yaml") -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def test_every_rayservice_has_its_serve_config():
    assert sorted(p.name for p in DEPLOY.glob("rayservice-*.yaml")) == sorted(SERVE_CONFIGS)


@pytest.mark.parametrize("name", sorted(set(SERVE_CONFIGS.values())))
def test_serve_config_validates_against_rays_schema(name):
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(_serve_config(name))
    (app,) = schema.applications
    assert app.import_path == "ray_app:app" and app.route_prefix == "/"


@pytest.mark.parametrize("name", sorted(set(SERVE_CONFIGS.values())))
def test_serve_config_args_and_deployments_match_the_builder(name):
    from ray_app.config import parse_app_args

    (app,) = _serve_config(name)["applications"]
    cfg = parse_app_args(app["args"])  # every key known, values valid ServerArgs
    names = {cfg.engine_deployment_options(d)["name"] for d in
             {"colocated": ["engine"], "disaggregated": ["prefill", "decode"]}[cfg.mode]}
    assert {d["name"] for d in app["deployments"]} <= names | {"Ingress"}
    assert cfg.opt("tpu_chips") == CHIPS_PER_HOST and cfg.opt("accelerator_type") == "TPU-V7X"
    hosts = cfg.hosts("engine")  # hosts_per_replica: the engine's mesh is every core of its hosts
    assert cfg.server_args.dp_size == cfg.server_args.ep_size == hosts * 2 * CHIPS_PER_HOST
    if hosts > 1:
        opts = cfg.engine_deployment_options("engine")
        assert opts["placement_group_strategy"] == "STRICT_SPREAD"
        assert [b["TPU"] for b in opts["placement_group_bundles"]] == [CHIPS_PER_HOST] * hosts


KUBERNETES_VERSION = "1.33"  # GKE's regular channel at the time of writing


def _pod_templates(svc: dict) -> list[tuple[str, dict]]:
    cluster = svc["spec"]["rayClusterConfig"]
    return [("head", cluster["headGroupSpec"]["template"])] + [
        (g["groupName"], g["template"]) for g in cluster["workerGroupSpecs"]]


@pytest.mark.parametrize("path", sorted(DEPLOY.glob("rayservice-*.yaml")), ids=lambda p: p.name)
def test_rayservice_kubernetes_fields_validate_against_kubernetes_schemas(path):
    kv = pytest.importorskip("kubernetes_validate")
    svc = yaml.safe_load(path.read_text())
    # ObjectMeta, checked as a ConfigMap's (a core kind whose only required field is metadata).
    kv.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": svc["metadata"]},
                KUBERNETES_VERSION, strict=True)
    for name, template in _pod_templates(svc):
        doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
               "template": template}
        kv.validate(doc, KUBERNETES_VERSION, strict=True)


def test_kubernetes_schema_check_catches_mistakes():
    """The schema check above can fail: a misspelt container field and a non-string
    nodeSelector value are refused."""
    kv = pytest.importorskip("kubernetes_validate")
    svc = yaml.safe_load(sorted(DEPLOY.glob("rayservice-*.yaml"))[0].read_text())
    _, template = _pod_templates(svc)[1]
    bad = [yaml.safe_load(yaml.safe_dump(template)) for _ in range(2)]
    bad[0]["spec"]["containers"][0]["resource"] = bad[0]["spec"]["containers"][0].pop("resources")
    bad[1]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"] = 2
    for template in bad:
        doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "w"},
               "template": template}
        with pytest.raises(kv.ValidationError):
            kv.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("path", sorted(DEPLOY.glob("rayservice-*.yaml")), ids=lambda p: p.name)
def test_rayservice(path):
    svc = yaml.safe_load(path.read_text())
    assert svc["apiVersion"] == "ray.io/v1" and svc["kind"] == "RayService"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", svc["metadata"]["name"])
    spec = svc["spec"]
    serve_config = _serve_config(SERVE_CONFIGS[path.name])
    assert yaml.safe_load(spec["serveConfigV2"]) == serve_config  # the same file, verbatim
    ray_pin = re.search(r'"ray\[serve\]==([0-9.]+)"', PYPROJECT.read_text()).group(1)
    cluster = spec["rayClusterConfig"]
    assert cluster["rayVersion"] == ray_pin
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert all(c["name"] and c["image"] for c in head)
    (app,) = serve_config["applications"]
    for group in cluster["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        sel = pod["nodeSelector"]
        assert sel["cloud.google.com/gke-tpu-accelerator"] == "tpu7x"
        topo = sel["cloud.google.com/gke-tpu-topology"]
        chips = math.prod(int(x) for x in topo.split("x"))
        assert group["numOfHosts"] == chips // CHIPS_PER_HOST
        assert int(app["args"].get("hosts_per_replica", 1)) == group["numOfHosts"]  # a slice each
        (container,) = pod["containers"]
        res = container["resources"]
        assert res["requests"]["google.com/tpu"] == res["limits"]["google.com/tpu"] == str(CHIPS_PER_HOST)
        assert str(app["args"]["tpu_chips"]) == res["limits"]["google.com/tpu"]
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        for m in container.get("volumeMounts", []):
            assert m["name"] in {v["name"] for v in pod["volumes"]}


SECRET = "sglang-api-keys"


@pytest.mark.parametrize("path", sorted(DEPLOY.glob("rayservice-*.yaml")), ids=lambda p: p.name)
def test_api_keys_come_from_a_secret_not_the_serve_config(path, monkeypatch):
    """Every Ray container gets both keys from the Secret (the application may be built on any
    node), under the names the builder reads; no key is written in the Serve config."""
    from ray_app.config import KEY_ENV_VARS, parse_app_args

    svc = yaml.safe_load(path.read_text())
    for name, template in _pod_templates(svc):
        for container in template["spec"]["containers"]:
            env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container.get("env", [])
                   if "secretKeyRef" in e.get("valueFrom", {})}
            assert set(env) == set(KEY_ENV_VARS.values()), (name, container["name"])
            assert {r["name"] for r in env.values()} == {SECRET}
            assert not any(r.get("optional") for r in env.values())  # no Secret: no pods
            assert env["SGLANG_API_KEY"]["key"] != env["SGLANG_ADMIN_API_KEY"]["key"]
    (app,) = _serve_config(SERVE_CONFIGS[path.name])["applications"]
    assert not set(app["args"]) & set(KEY_ENV_VARS)
    monkeypatch.setenv("SGLANG_API_KEY", "u")
    monkeypatch.setenv("SGLANG_ADMIN_API_KEY", "a")
    sa = parse_app_args(app["args"]).server_args
    assert (sa.api_key, sa.admin_api_key) == ("u", "a")


@pytest.mark.parametrize("path", sorted(DEPLOY.glob("rayservice-*.yaml")), ids=lambda p: p.name)
def test_ray_ports_are_cluster_internal(path):
    """The dashboard (jobs API) and Ray's other ports: a ClusterIP head service, and the
    NetworkPolicy selects every pod of the RayService and opens only Serve's port to clients."""
    svc = yaml.safe_load(path.read_text())
    cluster = svc["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"].get("serviceType") == "ClusterIP"
    policy = yaml.safe_load((DEPLOY / "networkpolicy-ray.yaml").read_text())
    selector = policy["spec"]["podSelector"]["matchLabels"]
    for name, template in _pod_templates(svc):
        assert selector.items() <= template["metadata"]["labels"].items(), name
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    port = _serve_config(SERVE_CONFIGS[path.name])["http_options"]["port"]
    for rule in policy["spec"]["ingress"]:
        if "from" not in rule:  # open to any client: Serve's port only
            assert rule["ports"] == [{"protocol": "TCP", "port": port}]
            continue
        for peer in rule["from"]:
            assert "ipBlock" not in peer
            assert (peer["podSelector"]["matchLabels"] == selector
                    or peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kuberay-operator"})


def test_networkpolicy_validates_against_kubernetes_schema():
    kv = pytest.importorskip("kubernetes_validate")
    kv.validate(yaml.safe_load((DEPLOY / "networkpolicy-ray.yaml").read_text()), KUBERNETES_VERSION,
                strict=True)
