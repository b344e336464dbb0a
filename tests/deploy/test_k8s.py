"""Kubernetes manifests: every kustomization builds with the real `kubectl kustomize` (load
restrictor on, as `kubectl apply -k` runs it), the output validates strictly against the
Kubernetes schema offline, every image comes from the one image setting, and every container
command parses with disagg's own CLI."""

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from disagg.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
IMAGE_SETTING = K8S / "image" / "kustomization.yaml"


def _kind(path: Path) -> str:
    return yaml.safe_load(path.read_text())["kind"]


# Every kustomization a user may build (components are built through them).
BUILDS = sorted(str(p.parent.relative_to(K8S)) for p in K8S.rglob("kustomization.yaml") if _kind(p) == "Kustomization")
OVERLAYS = ["base", "overlays/tcp", "overlays/rdma", "overlays/scale-out", "overlays/tp", "preflight"]
K8S_VERSION = {"overlays/same-node": "1.34"}  # DRA (resource.k8s.io/v1) is GA from 1.34
IMAGES = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in yaml.safe_load(IMAGE_SETTING.read_text())["images"]}


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl is not installed: scripts/setup.sh installs it")
    return path


def kustomize(name: str) -> list[dict]:
    """`kubectl kustomize deploy/k8s/NAME`, parsed; a build error fails with kubectl's message."""
    run = subprocess.run([kubectl(), "kustomize", str(K8S / name)], capture_output=True, text=True, timeout=60)
    if run.returncode != 0:
        pytest.fail(f"kubectl kustomize deploy/k8s/{name}: {run.stderr.strip()}")
    return [d for d in yaml.safe_load_all(run.stdout) if d]


def _containers(obj: dict) -> list[dict]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", []) + spec.get("initContainers", [])


@pytest.fixture(scope="module", params=BUILDS)
def built(request) -> tuple[str, list[dict]]:
    return request.param, kustomize(request.param)


def test_every_kustomization_is_built():
    assert set(OVERLAYS) | {"overlays/same-node"} <= set(BUILDS), BUILDS


def test_every_object_validates_strictly_against_the_schema(built):
    name, objects = built
    assert objects
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION.get(name, "1.30"), strict=True)


def test_every_image_comes_from_the_one_image_setting(built):
    """deploy/k8s/image names the image once; a container whose image it does not map (a
    placeholder left over, a tag written into a manifest) would be pulled from nowhere."""
    _, objects = built
    images = [c["image"] for obj in objects for c in _containers(obj)]
    assert images and set(images) <= set(IMAGES.values()), (images, IMAGES)


def test_no_kustomization_but_the_image_setting_sets_images():
    for path in K8S.rglob("kustomization.yaml"):
        if path != IMAGE_SETTING:
            assert "images" not in yaml.safe_load(path.read_text()), path


def _image_user() -> int:
    """The uid both images run as (their last USER; tests/deploy/test_docker.py checks them)."""
    users = {
        re.findall(r"^USER (\S+)$", (ROOT / "deploy" / "docker" / f).read_text(), re.M)[-1]
        for f in ("Dockerfile", "Dockerfile.cpu")
    }
    (user,) = users
    return int(user)


def test_every_pod_runs_as_the_images_user_and_can_read_its_key(built):
    """Pods run as the images' unprivileged uid (runAsNonRoot); the deployment key is a Secret
    file owned by root, mode 0400, so a non-root process reads it only through fsGroup (the
    kubelet gives that group read access). The one exception, rdma's workers, run as root for
    IPC_LOCK and say so."""
    _, objects = built
    for obj in objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec")
        if pod is None:
            continue
        pod_sc = pod.get("securityContext", {})
        assert pod_sc.get("runAsNonRoot") is True and pod_sc.get("runAsUser") == _image_user(), obj["metadata"]["name"]
        for c in _containers(obj):
            sc = {**pod_sc, **c.get("securityContext", {})}
            reads_key = any(m["name"] == "auth" for m in c.get("volumeMounts", []))
            if sc["runAsUser"] == 0:
                assert sc["runAsNonRoot"] is False and "IPC_LOCK" in sc["capabilities"]["add"], c["name"]
            elif reads_key:
                assert pod_sc.get("fsGroup") is not None, f"{obj['metadata']['name']}/{c['name']} cannot read the key"


def test_every_container_command_parses_with_the_cli(built):
    _, objects = built
    parser = build_parser()
    for obj in objects:
        for c in _containers(obj):
            try:
                args = parser.parse_args(c["args"])
            except SystemExit:
                pytest.fail(f"{obj['metadata']['name']}: `disagg {shlex.join(c['args'])}` does not parse")
            assert args.command == c["args"][0]


@pytest.mark.parametrize("name", OVERLAYS)
def test_workers_are_wired_for_a_cluster(name):
    objects = kustomize(name)
    by = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    if name == "preflight":  # an HTTP client: the CPU image serves on any cluster
        (c,) = _containers(by[("Job", "disagg-preflight")])
        assert "--router" in c["args"] and c["image"] == IMAGES["disagg-cpu"]
        return
    assert _containers(by[("Deployment", "disagg-router")])[0]["image"] == IMAGES["disagg-cpu"]
    config = by[("ConfigMap", "disagg-config")]["data"]
    for role in ("prefill", "decode"):
        sts = by[("StatefulSet", f"disagg-{role}")]
        spec = sts["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        env = {e["name"]: e for e in c.get("env", [])}
        assert env["DISAGG_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        ports = {p["name"] for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"]["port"] in ports
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["livenessProbe"]["httpGet"]["path"] == "/health"
        shm = [v for v in spec["volumes"] if v["name"] == "dshm"][0]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert sts["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        assert spec["terminationGracePeriodSeconds"] >= 10
        assert sts["spec"]["serviceName"] in {n for k, n in by if k == "Service"}
        # the deployment key: a Secret mounted read-only where DISAGG_AUTH_KEY points, never a flag
        auth = [v for v in spec["volumes"] if v["name"] == "auth"][0]
        assert auth["secret"]["secretName"] == "disagg-auth" and auth["secret"]["defaultMode"] == 0o400
        mount = [m for m in c["volumeMounts"] if m["name"] == "auth"][0]
        assert mount["readOnly"] and config["DISAGG_AUTH_KEY"].startswith(mount["mountPath"] + "/")
        assert "--insecure" not in c["args"] and "--auth-key" not in c["args"]
    assert config["DISAGG_HTTP_HOST"] == "0.0.0.0"
    _admits_only_who_needs_it(by)
    # the router's pairs name pods that exist behind headless services
    router = by[("Deployment", "disagg-router")]
    pairs = [
        a for i, a in enumerate(_containers(router)[0]["args"]) if _containers(router)[0]["args"][i - 1] == "--pair"
    ]
    assert pairs
    for pair in pairs:
        for host in re.findall(r"//([a-z0-9-]+)\.([a-z0-9-]+):", pair):
            pod, service = host
            sts = by[("StatefulSet", service)]
            ordinal = int(pod.rsplit("-", 1)[1])
            assert pod.startswith(service) and ordinal < sts["spec"]["replicas"], pair
    # each pair's bootstrap is one its decode was configured with (decode refuses any other)
    (dec,) = _containers(by[("StatefulSet", "disagg-decode")])
    known = {"default"}
    for name_, endpoint in build_parser().parse_args(dec["args"]).bootstrap_addr or [("", "tcp://127.0.0.1:8998")]:
        known |= {name_ or endpoint, endpoint}
    for pair in pairs:
        assert pair.split(",")[2] in known, (pair, known)
    if name == "overlays/rdma":
        assert (
            config["DISAGG_MOONCAKE_PROTOCOL"] == "rdma"
            and config["DISAGG_DEVICE"] == "cuda"
            and config["DISAGG_RDMA_DEVICES"]
        )
        for role in ("prefill", "decode"):
            (c,) = _containers(by[("StatefulSet", f"disagg-{role}")])
            assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
            assert c["securityContext"]["runAsUser"] == 0  # a non-root process gets no capability
            assert c["image"] == IMAGES["disagg-cuda"]
            assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
            assert any(k.startswith("rdma/") for k in c["resources"]["limits"])
    if name == "overlays/scale-out":
        # every prefill with every decode: the router chooses the two independently (--route kv)
        sides = {tuple(p.split(",")[:2]) for p in pairs}
        prefills, decodes = {p for p, _ in sides}, {d for _, d in sides}
        assert len(prefills) == len(decodes) == 2 and sides == {(p, d) for p in prefills for d in decodes}
        assert by[("StatefulSet", "disagg-prefill")]["spec"]["replicas"] == 2
    if name == "overlays/tp":  # one pod per rank: TP size = replicas, rank = the pod's ordinal
        (pair,) = pairs
        for role, urls in zip(("prefill", "decode"), pair.split(",")[:2]):
            sts = by[("StatefulSet", f"disagg-{role}")]
            env = {e["name"]: e for e in _containers(sts)[0]["env"]}
            assert env["DISAGG_TP_SIZE"]["value"] == str(sts["spec"]["replicas"]) == str(len(urls.split("+")))
            assert (
                env["DISAGG_TP_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
                == "metadata.labels['apps.kubernetes.io/pod-index']"
            )
            assert [int(u.split(".")[0].rsplit("-", 1)[1]) for u in urls.split("+")] == list(
                range(len(urls.split("+")))
            )
        args = build_parser().parse_args(_containers(by[("StatefulSet", "disagg-prefill")])[0]["args"])
        assert args.bootstrap_bind == "none" and args.bootstrap_addr == pair.split(",")[2]
        boot = by[("Deployment", "disagg-bootstrap")]
        assert build_parser().parse_args(_containers(boot)[0]["args"]).command == "bootstrap"


def _admits_only_who_needs_it(by: dict) -> None:
    """NetworkPolicies: deny by default; each worker port open to the pods that use it."""
    policies = [o["spec"] for (kind, _), o in by.items() if kind == "NetworkPolicy"]
    deny = [p for p in policies if p["podSelector"] == {"matchLabels": {"app.kubernetes.io/part-of": "disagg"}}]
    assert deny and "ingress" not in deny[0] and deny[0]["policyTypes"] == ["Ingress"]

    def sources(role: str, port: int) -> set[str]:
        names = set()
        for p in policies:
            sel = p["podSelector"]
            if sel.get("matchLabels", {}).get(
                "app.kubernetes.io/name"
            ) != f"disagg-{role}" and f"disagg-{role}" not in (sel.get("matchExpressions", [{}])[0].get("values", [])):
                continue
            for rule in p.get("ingress", []):
                if any(q["port"] <= port <= q.get("endPort", q["port"]) for q in rule["ports"]):
                    names |= {
                        f["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
                        for f in rule.get("from", [])
                        if "podSelector" in f
                    }
        return names

    assert sources("prefill", 9000) == sources("prefill", 8998) == {"disagg-decode", "disagg-prefill"}
    assert sources("decode", 20000) == {"disagg-prefill"}  # Mooncake's ports: prefill writes, no one else
    assert sources("decode", 8080) == sources("prefill", 8080) == {"disagg-router"}


def test_the_same_node_pair_is_one_pod_whose_containers_share_two_gpus():
    """overlays/same-node: prefill and decode in one pod (shared process namespace, one host
    identity), each on its own GPU of one DRA claim both containers see, so CUDA IPC works;
    the router reaches both by port, and its own front door comes with it."""
    objects = kustomize("overlays/same-node")
    by = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    parser = build_parser()
    pod = by[("StatefulSet", "disagg-pair")]["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    (claim,) = pod["resourceClaims"]
    template = by[("ResourceClaimTemplate", claim["resourceClaimTemplateName"])]["spec"]["spec"]
    (request,) = template["devices"]["requests"]
    assert request["exactly"]["count"] == 2
    containers = {c["name"]: c for c in pod["containers"]}
    args = {name: parser.parse_args(c["args"]) for name, c in containers.items()}
    assert {a.command for a in args.values()} == {"prefill", "decode"} == set(containers)
    for name, c in containers.items():
        assert c["resources"]["claims"] == [{"name": claim["name"]}]  # both see both GPUs
        assert c["image"] == IMAGES["disagg-cuda"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"]["port"] in ports
        assert ports[c["readinessProbe"]["httpGet"]["port"]] == args[name].http_port
    assert args["prefill"].device != args["decode"].device and args["prefill"].device.startswith("cuda:")
    assert args["decode"].bootstrap_addr[0][1] == args["prefill"].bootstrap_bind
    config = by[("ConfigMap", "disagg-config")]["data"]
    assert config["DISAGG_DEVICE"] == "cuda" and config["DISAGG_TRANSPORT"] == "auto"
    router = _containers(by[("Deployment", "disagg-router")])[0]["args"]
    pair = router[router.index("--pair") + 1].split(",")
    assert pair == [
        f"http://disagg-pair-0.disagg-pair:{args['prefill'].http_port}",
        f"http://disagg-pair-0.disagg-pair:{args['decode'].http_port}",
        args["prefill"].bootstrap_bind,
    ]
    service = by[("Service", "disagg-pair")]["spec"]
    assert {p["port"] for p in service["ports"]} == {args["prefill"].http_port, args["decode"].http_port}
