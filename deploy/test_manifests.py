#!/usr/bin/python3
"""Checks of the deployment files against each other and against the server.

  test_manifests.py PATH/TO/attnserve [unittest options]

Parses every Kubernetes manifest, deploy/compose.yaml, deploy/nginx/nginx.conf
and the Dockerfile, and checks that what the server relies on agrees: every
flag they pass exists in `attnserve --helpfull`, ports, probes, the grace
period against the drain, threads against the CPU limit, Service and
PodDisruptionBudget selectors, the autoscaler's target, nginx's upstreams
against the compose replicas, and the KServe ServingRuntime and
InferenceService (protocol v2 over HTTP and gRPC, ports, model storage, the
Deployment's image). Needs Debian's python3-yaml.
"""

import glob
import os
import re
import subprocess
import sys
import unittest

import yaml

DEPLOY = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DEPLOY)
KUBERNETES = os.path.join(DEPLOY, "kubernetes")
KSERVE = os.path.join(KUBERNETES, "kserve")
# Where KServe's storage initializer puts an InferenceService's storageUri.
KSERVE_MODEL_DIR = "/mnt/models"
ATTNSERVE = None  # set from the command line

KNOWN_KINDS = {
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("v1", "ConfigMap"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
    ("policy/v1", "PodDisruptionBudget"),
}


def server_flags():
    """{flag name: default as printed} from `attnserve --helpfull`."""
    result = subprocess.run([ATTNSERVE, "--helpfull"], capture_output=True,
                            text=True, timeout=30, check=False)
    text = result.stdout + result.stderr
    flags = {}
    for match in re.finditer(r"^\s+--(\w+) \((.*?)\);\s+default: (.*?);$", text,
                             re.MULTILINE | re.DOTALL):
        flags[match.group(1)] = match.group(3).strip().strip('"')
    return flags


def parse_flags(args):
    """{name: value} of the --name=value (or --name) arguments."""
    out = {}
    for arg in args:
        if not arg.startswith("--"):
            continue
        name, _, value = arg[2:].partition("=")
        out[name] = value
    return out


def cpu_cores(quantity):
    """Kubernetes CPU quantity ("2", 2, "1500m") in cores."""
    text = str(quantity)
    if text.endswith("m"):
        return int(text[:-1]) / 1000
    return float(text)


def memory_mib(quantity):
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 * 1024,
             "K": 1e3 / 2**20, "M": 1e6 / 2**20, "G": 1e9 / 2**20}
    text = str(quantity)
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * units[suffix]
    return float(text) / 2**20


def duration_seconds(text):
    """Compose duration ("30s", "1m30s") in seconds."""
    total = 0.0
    for number, unit in re.findall(r"([\d.]+)(ms|s|m|h)", str(text)):
        total += float(number) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return total


def load_manifests(folder=KUBERNETES):
    """[(file name, document)] for every manifest but the kustomization."""
    docs = []
    for path in sorted(glob.glob(os.path.join(folder, "*.yaml"))):
        if os.path.basename(path) == "kustomization.yaml":
            continue
        with open(path, encoding="utf-8") as f:
            for doc in yaml.safe_load_all(f):
                if doc is not None:
                    docs.append((os.path.basename(path), doc))
    return docs


class DeployFilesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.flags = server_flags()
        cls.manifests = load_manifests()
        with open(os.path.join(KUBERNETES, "kustomization.yaml"), encoding="utf-8") as f:
            cls.kustomization = yaml.safe_load(f)
        with open(os.path.join(DEPLOY, "compose.yaml"), encoding="utf-8") as f:
            cls.compose = yaml.safe_load(f)
        with open(os.path.join(DEPLOY, "nginx", "nginx.conf"), encoding="utf-8") as f:
            cls.nginx = f.read()
        with open(os.path.join(ROOT, "Dockerfile"), encoding="utf-8") as f:
            cls.dockerfile = f.read()
        with open(os.path.join(DEPLOY, "lb-test.sh"), encoding="utf-8") as f:
            cls.lb_test = f.read()

    # Helpers.
    def of_kind(self, kind):
        return [doc for _, doc in self.manifests if doc["kind"] == kind]

    def one(self, kind):
        docs = self.of_kind(kind)
        self.assertEqual(len(docs), 1, f"expected one {kind}, found {len(docs)}")
        return docs[0]

    def pod_spec(self):
        return self.one("Deployment")["spec"]["template"]["spec"]

    def server_container(self):
        containers = self.pod_spec()["containers"]
        matches = [c for c in containers if c["command"][0].endswith("/attnserve")]
        self.assertEqual(len(matches), 1, "one container runs attnserve")
        return matches[0]

    def server_args(self):
        return parse_flags(self.server_container()["args"])

    def flag(self, args, name):
        """A flag's value in args, else the server's default."""
        return args.get(name, self.flags[name])

    def assertFlagsExist(self, args, where):
        for arg in args:
            self.assertTrue(arg.startswith("--"), f"{where}: '{arg}' is not a --flag")
            name = arg[2:].partition("=")[0]
            self.assertIn(name, self.flags, f"{where}: --{name} is not an attnserve flag")

    # The server's own flags, as a sanity check of the parsing above.
    def test_helpfull_lists_the_server_flags(self):
        for name in ("port", "metrics_port", "threads", "drain_seconds",
                     "lame_duck_seconds", "model_repository", "max_inflight",
                     "max_queue"):
            self.assertIn(name, self.flags)
        self.assertEqual(self.flags["port"], "50051")
        self.assertEqual(self.flags["metrics_port"], "9090")

    # Kubernetes.
    def test_manifests_parse_with_known_kinds(self):
        self.assertTrue(self.manifests)
        for name, doc in self.manifests:
            self.assertIn((doc.get("apiVersion"), doc.get("kind")), KNOWN_KINDS, name)
            self.assertTrue(doc["metadata"]["name"], name)
        kinds = sorted(doc["kind"] for _, doc in self.manifests)
        self.assertEqual(kinds, ["ConfigMap", "Deployment", "HorizontalPodAutoscaler",
                                 "PodDisruptionBudget", "Service", "Service"])

    def test_kustomization_lists_every_manifest(self):
        k = self.kustomization
        self.assertEqual(k["apiVersion"], "kustomize.config.k8s.io/v1beta1")
        self.assertEqual(k["kind"], "Kustomization")
        files = {os.path.basename(p) for p in glob.glob(os.path.join(KUBERNETES, "*.yaml"))}
        files.discard("kustomization.yaml")
        self.assertEqual(set(k["resources"]), files)
        images = {image["name"] for image in k.get("images", [])}
        spec = self.pod_spec()
        for container in spec["containers"] + spec.get("initContainers", []):
            self.assertIn(container["image"], images,
                          f"kustomization sets no image for {container['name']}")

    def test_container_flags_are_server_flags(self):
        container = self.server_container()
        self.assertFlagsExist(container["args"], "Deployment args")

    def test_container_ports_match_flags(self):
        args = self.server_args()
        ports = {p["name"]: p["containerPort"] for p in self.server_container()["ports"]}
        self.assertEqual(ports["grpc"], int(self.flag(args, "port")))
        self.assertEqual(ports["metrics"], int(self.flag(args, "metrics_port")))
        self.assertEqual(self.flag(args, "host"), "0.0.0.0")
        annotations = self.one("Deployment")["spec"]["template"]["metadata"]["annotations"]
        self.assertEqual(annotations["prometheus.io/scrape"], "true")
        self.assertEqual(int(annotations["prometheus.io/port"]), ports["metrics"])
        self.assertEqual(annotations["prometheus.io/path"], "/metrics")

    def test_probes_use_grpc_health_on_the_grpc_port(self):
        container = self.server_container()
        port = int(self.flag(self.server_args(), "port"))
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            self.assertIn(probe, container)
            self.assertEqual(container[probe]["grpc"]["port"], port, probe)
            self.assertIn(container[probe]["grpc"].get("service", ""),
                          ("", "attnserve.v1.AttentionService"), probe)

    def test_grace_period_covers_prestop_and_drain(self):
        spec = self.pod_spec()
        container = self.server_container()
        pre_stop = container["lifecycle"]["preStop"]
        if "sleep" in pre_stop:
            pre_stop_seconds = int(pre_stop["sleep"]["seconds"])
        else:
            command = pre_stop["exec"]["command"]
            self.assertTrue(command[0].endswith("sleep"), command)
            pre_stop_seconds = int(command[1])
        self.assertGreater(pre_stop_seconds, 0)
        drain = int(self.flag(self.server_args(), "drain_seconds"))
        self.assertGreater(spec["terminationGracePeriodSeconds"], drain + pre_stop_seconds)

    def assertLameDuckWithinDrain(self, args, where):
        # The lame duck is the first part of the drain (the server refuses
        # to start otherwise).
        lame_duck = int(self.flag(args, "lame_duck_seconds"))
        drain = int(self.flag(args, "drain_seconds"))
        if lame_duck > 0:
            self.assertLess(lame_duck, drain, where)

    def test_lame_duck_is_part_of_the_drain(self):
        self.assertLameDuckWithinDrain(self.server_args(), "Deployment")
        for name, service in self.replicas().items():
            self.assertLameDuckWithinDrain(parse_flags(service["command"]), f"compose {name}")

    def test_threads_match_cpu_limit(self):
        resources = self.server_container()["resources"]
        args = self.server_args()
        limit = cpu_cores(resources["limits"]["cpu"])
        self.assertEqual(limit, int(limit), "whole CPUs")
        self.assertEqual(int(self.flag(args, "threads")), int(limit))
        self.assertIn("cpu", resources["requests"], "the autoscaler needs a CPU request")
        self.assertIn("memory", resources["limits"])
        # The calls computing at once fit in the memory limit.
        inflight = int(self.flag(args, "max_inflight")) or int(limit)
        self.assertLess(inflight * int(self.flag(args, "max_request_memory_mb")),
                        memory_mib(resources["limits"]["memory"]))

    def test_pods_run_as_non_root_with_read_only_root(self):
        spec = self.pod_spec()
        pod = spec.get("securityContext", {})
        self.assertTrue(pod.get("runAsNonRoot"))
        self.assertEqual(pod.get("runAsUser"), 10001)
        for container in spec["containers"] + spec.get("initContainers", []):
            context = container.get("securityContext", {})
            self.assertTrue(context.get("readOnlyRootFilesystem"), container["name"])
            self.assertFalse(context.get("allowPrivilegeEscalation", True), container["name"])
            self.assertEqual(context.get("runAsUser", pod.get("runAsUser")), 10001)

    def test_model_repository_is_a_mounted_volume(self):
        spec = self.pod_spec()
        path = self.server_args()["model_repository"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in self.server_container()["volumeMounts"]}
        self.assertIn(path, mounts, "--model_repository is a volume mount")
        self.assertIn(mounts[path], volumes)
        # The init container fills the same volume.
        filled = [c for c in spec.get("initContainers", [])
                  if any(m["name"] == mounts[path] for m in c.get("volumeMounts", []))]
        self.assertTrue(filled, "an init container writes the model repository")
        # Model configs come from the ConfigMap.
        config_maps = {doc["metadata"]["name"]: doc for doc in self.of_kind("ConfigMap")}
        referenced = [v["configMap"]["name"] for v in volumes.values() if "configMap" in v]
        self.assertTrue(referenced)
        for name in referenced:
            self.assertIn(name, config_maps)
            for key, value in config_maps[name]["data"].items():
                self.assertTrue(key.endswith(".config.pbtxt"), key)
                self.assertRegex(value, r"(?m)^num_heads: \d+$")

    def test_services_select_the_pods_and_target_their_ports(self):
        deployment = self.one("Deployment")
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        for key, value in deployment["spec"]["selector"]["matchLabels"].items():
            self.assertEqual(labels.get(key), value)
        ports = self.server_container()["ports"]
        by_name = {p["name"]: p["containerPort"] for p in ports}
        numbers = set(by_name.values())
        services = self.of_kind("Service")
        self.assertEqual(sorted(s["spec"].get("clusterIP", "") == "None" for s in services),
                         [False, True], "one headless and one ClusterIP Service")
        for service in services:
            name = service["metadata"]["name"]
            self.assertTrue(service["spec"]["selector"])
            for key, value in service["spec"]["selector"].items():
                self.assertEqual(labels.get(key), value, name)
            grpc_ports = []
            for port in service["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                if isinstance(target, str):
                    self.assertIn(target, by_name, f"{name}: no container port {target}")
                    number = by_name[target]
                else:
                    number = target
                self.assertIn(number, numbers, f"{name}: targetPort {target}")
                if number == by_name["grpc"]:
                    grpc_ports.append(port)
            self.assertEqual(len(grpc_ports), 1, f"{name} exposes the gRPC port")

    def test_autoscaler_targets_the_deployment(self):
        hpa = self.one("HorizontalPodAutoscaler")
        deployment = self.one("Deployment")
        target = hpa["spec"]["scaleTargetRef"]
        self.assertEqual((target["apiVersion"], target["kind"], target["name"]),
                         ("apps/v1", "Deployment", deployment["metadata"]["name"]))
        metrics = hpa["spec"]["metrics"]
        self.assertIn(("Resource", "cpu"),
                      [(m["type"], m.get("resource", {}).get("name")) for m in metrics])
        self.assertGreaterEqual(hpa["spec"]["minReplicas"], 2)
        self.assertGreaterEqual(hpa["spec"]["maxReplicas"], hpa["spec"]["minReplicas"])
        self.assertNotIn("replicas", deployment["spec"], "the autoscaler owns the count")

    def test_disruption_budget_selects_the_pods(self):
        pdb = self.one("PodDisruptionBudget")
        labels = self.one("Deployment")["spec"]["template"]["metadata"]["labels"]
        selector = pdb["spec"]["selector"]["matchLabels"]
        self.assertTrue(selector)
        for key, value in selector.items():
            self.assertEqual(labels.get(key), value)
        min_replicas = self.one("HorizontalPodAutoscaler")["spec"]["minReplicas"]
        if "maxUnavailable" in pdb["spec"]:
            self.assertLess(int(pdb["spec"]["maxUnavailable"]), min_replicas)
        else:
            self.assertLess(int(pdb["spec"]["minAvailable"]), min_replicas)

    # Compose and nginx.
    def replicas(self):
        services = self.compose["services"]
        return {name: s for name, s in services.items() if name.startswith("attnserve")}

    def test_compose_replicas(self):
        replicas = self.replicas()
        self.assertEqual(len(replicas), 3)
        for name, service in replicas.items():
            args = parse_flags(service["command"])
            self.assertFlagsExist(service["command"], f"compose {name}")
            port = self.flag(args, "port")
            self.assertIn(port, [str(p) for p in service["expose"]], name)
            self.assertIn(self.flag(args, "metrics_port"), [str(p) for p in service["expose"]])
            test = " ".join(service["healthcheck"]["test"])
            self.assertIn("attnctl health", test, name)
            self.assertIn(f"--target=127.0.0.1:{port}", test, name)
            self.assertGreater(duration_seconds(service["stop_grace_period"]),
                               int(self.flag(args, "drain_seconds")), name)
            threads = int(self.flag(args, "threads"))
            if threads:
                self.assertLessEqual(threads, float(service["cpus"]), name)
            else:
                self.assertIn("cpus", service, f"{name}: --threads=0 needs a CPU limit")
            self.assertTrue(service.get("read_only"), name)
            self.assertTrue(str(service.get("user", "")).startswith("10001"), name)

    def test_nginx_upstreams_are_the_compose_replicas(self):
        upstream = re.search(r"upstream attnserve \{(.*?)\}", self.nginx, re.DOTALL)
        self.assertIsNotNone(upstream)
        servers = dict(re.findall(r"^\s*server ([\w.-]+):(\d+)\b", upstream.group(1), re.MULTILINE))
        expected = {name: self.flag(parse_flags(s["command"]), "port")
                    for name, s in self.replicas().items()}
        self.assertEqual(servers, expected)
        self.assertRegex(self.nginx, r"grpc_pass grpc://attnserve;")
        next_upstream = re.search(r"grpc_next_upstream ([^;]*);", self.nginx).group(1).split()
        for condition in ("error", "timeout", "non_idempotent"):
            self.assertIn(condition, next_upstream)
        # nginx's own failures reach clients as gRPC UNAVAILABLE.
        self.assertRegex(self.nginx, r"error_page 502 503 504 = @grpc_unavailable;")
        self.assertRegex(self.nginx, r"add_header grpc-status 14 always;")
        # Decode sessions: one replica per x-session-key, the same replicas.
        sessions = re.search(r"upstream attnserve_sessions \{(.*?)\}", self.nginx, re.DOTALL)
        self.assertIsNotNone(sessions)
        self.assertIn("hash $http_x_session_key consistent;", sessions.group(1))
        self.assertEqual(dict(re.findall(r"^\s*server ([\w.-]+):(\d+)\b", sessions.group(1),
                                         re.MULTILINE)), expected)
        self.assertRegex(self.nginx, r"\(CreateSession\|SessionStep\|SessionSteps\|ForkSession\|DeleteSession\)\$ \{\s*"
                                     r"grpc_pass grpc://attnserve_sessions;")
        # Open Inference requests with a key (a sequence's) take the same
        # hash; those without go to any replica.
        route = re.search(r"map \$http_x_session_key \$inference_upstream \{(.*?)\}",
                          self.nginx, re.DOTALL)
        self.assertIsNotNone(route)
        self.assertRegex(route.group(1), r'""\s+attnserve;')
        self.assertRegex(route.group(1), r"default\s+attnserve_sessions;")
        self.assertRegex(self.nginx, r"\(ModelInfer\|ModelStreamInfer\)\$ \{\s*"
                                     r"grpc_pass grpc://\$inference_upstream;")
        body = re.search(r"client_max_body_size (\d+)m;", self.nginx)
        self.assertGreaterEqual(int(body.group(1)), int(self.flags["max_message_mb"]))

    def test_compose_nginx_publishes_its_listen_port(self):
        listen = re.search(r"^\s*listen (\d+) http2;", self.nginx, re.MULTILINE)
        self.assertIsNotNone(listen, "nginx listens with http2")
        nginx = self.compose["services"]["nginx"]
        published = [str(p).rsplit(":", 1)[-1] for p in nginx["ports"]]
        self.assertIn(listen.group(1), published)
        self.assertIn("./nginx/nginx.conf:/etc/nginx/nginx.conf:ro", nginx["volumes"])
        for name in self.replicas():
            self.assertEqual(nginx["depends_on"][name]["condition"], "service_healthy")
        self.assertIn(f"127.0.0.1:{listen.group(1)}/nginx-health",
                      " ".join(nginx["healthcheck"]["test"]))

    def test_lb_test_runs_the_same_nginx_config(self):
        self.assertIn('"$root/deploy/nginx/nginx.conf"', self.lb_test)
        listen = re.search(r"^\s*listen (\d+) http2;", self.nginx, re.MULTILINE).group(1)
        self.assertIn(f"listen {listen} ", self.lb_test)
        for name, port in re.findall(r"^\s*server ([\w.-]+):(\d+)\b", self.nginx, re.MULTILINE):
            self.assertIn(f"server {name}:{port}", self.lb_test)
        self.assertIn("include attnserve.d/*.conf;", self.nginx)

    # The image.
    def test_dockerfile(self):
        self.assertRegex(self.dockerfile, r"(?m)^FROM debian:bookworm-slim AS build$")
        self.assertRegex(self.dockerfile, r"(?m)^FROM debian:bookworm-slim$")
        expose = re.search(r"(?m)^EXPOSE (.*)$", self.dockerfile).group(1).split()
        self.assertEqual(sorted(expose), sorted([self.flags["port"], self.flags["metrics_port"],
                                                self.flags["http_port"]]))
        self.assertRegex(self.dockerfile, r"(?m)^USER 10001")
        health = re.search(r"(?ms)^HEALTHCHECK .*?CMD (\[.*?\])$", self.dockerfile)
        self.assertIsNotNone(health)
        self.assertIn(f'"--target=127.0.0.1:{self.flags["port"]}"', health.group(1))
        self.assertIn('"health"', health.group(1))
        for instruction in ("ENTRYPOINT", "CMD"):
            line = re.search(rf"(?m)^{instruction} (\[.*\])$", self.dockerfile).group(1)
            args = yaml.safe_load(line)
            self.assertFlagsExist([a for a in args if a.startswith("--")], instruction)

    def test_scripts_parse(self):
        for script in ("container-test.sh", "lb-test.sh", "entrypoint.sh"):
            path = os.path.join(DEPLOY, script)
            shell = "sh" if script == "entrypoint.sh" else "bash"
            result = subprocess.run([shell, "-n", path], capture_output=True, text=True,
                                    check=False)
            self.assertEqual(result.returncode, 0, f"{script}: {result.stderr}")
            self.assertTrue(os.access(path, os.X_OK), f"{script} is executable")


class KServeTest(unittest.TestCase):
    """The ServingRuntime and InferenceService, as far as they can be checked
    without a cluster: against the server's flags and the Deployment."""

    @classmethod
    def setUpClass(cls):
        cls.flags = server_flags()
        cls.docs = {doc["kind"]: doc for _, doc in load_manifests(KSERVE)}
        with open(os.path.join(KUBERNETES, "kustomization.yaml"), encoding="utf-8") as f:
            cls.kustomization = yaml.safe_load(f)
        cls.deployment = next(doc for _, doc in load_manifests()
                              if doc["kind"] == "Deployment")

    def runtime(self):
        return self.docs["ServingRuntime"]

    def container(self):
        containers = self.runtime()["spec"]["containers"]
        self.assertEqual(len(containers), 1)
        return containers[0]

    def args(self):
        return parse_flags(self.container()["args"])

    def flag(self, name):
        return self.args().get(name, self.flags[name])

    def test_kinds(self):
        self.assertEqual(len(load_manifests(KSERVE)), 2)
        self.assertEqual(self.runtime()["apiVersion"], "serving.kserve.io/v1alpha1")
        self.assertEqual(self.docs["InferenceService"]["apiVersion"],
                         "serving.kserve.io/v1beta1")
        # They need KServe's CRDs: not applied with the plain manifests.
        self.assertFalse(any("kserve" in r for r in self.kustomization["resources"]))

    def test_runtime_runs_the_server_of_the_deployment_image(self):
        container = self.container()
        self.assertEqual(container["name"], "kserve-container")
        self.assertTrue(container["command"][0].endswith("/attnserve"))
        for arg in container["args"]:
            name = arg[2:].partition("=")[0]
            self.assertTrue(arg.startswith("--"), arg)
            self.assertIn(name, self.flags, f"--{name} is not an attnserve flag")
        image = next(i for i in self.kustomization["images"] if i["name"] == "attnserve")
        self.assertEqual(container["image"], f"{image['newName']}:{image['newTag']}")
        deployment_args = parse_flags(
            self.deployment["spec"]["template"]["spec"]["containers"][0]["args"])
        self.assertEqual(deployment_args["threads"], self.flag("threads"))

    def test_protocol_v2_over_http_and_grpc_on_the_flag_ports(self):
        spec = self.runtime()["spec"]
        self.assertEqual(sorted(spec["protocolVersions"]), ["grpc-v2", "v2"])
        ports = {p["name"]: p["containerPort"] for p in self.container()["ports"]}
        # KServe's names: http1 for HTTP/1.1, h2c for cleartext HTTP/2 (gRPC).
        self.assertEqual(ports, {"http1": int(self.flag("http_port")),
                                 "h2c": int(self.flag("port"))})
        self.assertEqual(self.container()["ports"][0]["name"], "http1",
                         "the first port is the one Knative routes")
        self.assertEqual(self.flag("host"), "0.0.0.0")
        annotations = self.runtime()["metadata"]["annotations"]
        self.assertEqual(int(annotations["prometheus.kserve.io/port"]),
                         int(self.flag("metrics_port")))
        self.assertEqual(annotations["prometheus.kserve.io/path"], "/metrics")
        for probe, path in (("readinessProbe", "/v2/health/ready"),
                            ("livenessProbe", "/v2/health/live")):
            self.assertEqual(self.container()[probe]["httpGet"],
                             {"path": path, "port": int(self.flag("http_port"))})

    def test_threads_match_cpu_limit(self):
        resources = self.container()["resources"]
        self.assertEqual(resources["requests"], resources["limits"])
        self.assertEqual(int(self.flag("threads")), cpu_cores(resources["limits"]["cpu"]))
        isvc = self.docs["InferenceService"]["spec"]["predictor"]["model"]
        self.assertEqual(isvc["resources"], resources)

    def test_non_root_with_read_only_root(self):
        security = self.container()["securityContext"]
        self.assertTrue(security["runAsNonRoot"])
        self.assertTrue(security["readOnlyRootFilesystem"])
        self.assertFalse(security["allowPrivilegeEscalation"])
        self.assertEqual(security["capabilities"]["drop"], ["ALL"])

    def test_inference_service_uses_the_runtime_and_its_storage(self):
        model = self.docs["InferenceService"]["spec"]["predictor"]["model"]
        self.assertEqual(model["runtime"], self.runtime()["metadata"]["name"])
        self.assertEqual(model["protocolVersion"], "v2")
        formats = [(f["name"], f["version"])
                   for f in self.runtime()["spec"]["supportedModelFormats"]]
        self.assertIn((model["modelFormat"]["name"], model["modelFormat"]["version"]),
                      formats)
        self.assertRegex(model["storageUri"], r"^(pvc|s3|gs|https?)://")
        # The storage is mounted where the server reads its repository.
        self.assertEqual(self.flag("model_repository"), KSERVE_MODEL_DIR)


if __name__ == "__main__":
    if len(sys.argv) < 2 or not os.access(sys.argv[1], os.X_OK):
        sys.exit("usage: test_manifests.py PATH/TO/attnserve [unittest options]")
    ATTNSERVE = sys.argv[1]
    unittest.main(argv=[sys.argv[0]] + sys.argv[2:], verbosity=2)
