#!/usr/bin/python3
"""Checks of the Prometheus rules and the Grafana dashboard (ctest
ObservabilityTest) against a live attnserve's /metrics page:

- `promtool check metrics` finds nothing to say about the page;
- `promtool check rules` and `promtool test rules` pass on
  deploy/prometheus/alerts.yaml and alerts_test.yaml;
- deploy/grafana/attnserve.json parses, and every metric its queries and
  the alert rules use is on the page (`up` aside, which Prometheus adds),
  and every metric on the page is on the dashboard.

Usage: test_observability.py ATTNSERVE_BINARY [unittest args]. Needs
promtool (Debian's prometheus package; PROMTOOL overrides), python3-yaml,
and the Python client's grpcio and numpy.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
import urllib.request

import grpc
import numpy as np
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "clients", "python"))
from attnserve_client import ServerProcess, connect, pb, to_tensor  # noqa

RULES_DIR = os.path.join(HERE, "prometheus")
DASHBOARD = os.path.join(HERE, "grafana", "attnserve.json")
SERVER_BIN = ""
PROMTOOL = os.environ.get("PROMTOOL") or shutil.which("promtool") or ""
# Series Prometheus makes itself for every target.
SYNTHETIC = {"up"}


def metric_names(expr):
    """Metric names in a PromQL expression: names before a selector's { or
    a range's [, and names of attnserve's own families anywhere."""
    expr = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # label values
    names = set(re.findall(r"(?<![\w$:])([a-zA-Z_:][\w:]*)\s*(?=[{\[])",
                           expr))
    names |= set(re.findall(r"\b(?:attnserve|process)_\w+", expr))
    return names


def dashboard_queries(dashboard):
    """Every PromQL query of the dashboard: panel targets (rows included)
    and template variables."""
    queries = []

    def walk(panels):
        for panel in panels:
            for target in panel.get("targets", []):
                queries.append((panel["title"], target["expr"]))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            if isinstance(query, dict):
                query = query["query"]
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", query)
            queries.append((f"${variable['name']}",
                            inner.group(1) if inner else query))
    return queries


class ObservabilityTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        if not PROMTOOL:
            raise unittest.SkipTest("promtool not found")
        cls.workdir = tempfile.TemporaryDirectory()
        cls.server = ServerProcess(
            [SERVER_BIN, "--host=127.0.0.1", "--port=0", "--metrics_port=0", "--http_port=-1",
             "--threads=1", "--log_level=error"],
            "attnserve listening on ", cls.workdir.name, "server")
        with open(cls.server.stdout) as f:
            cls.metrics_port = int(
                re.search(r"metrics port (\d+)", f.read()).group(1))
        # Calls of each outcome, so that every family has samples: OK
        # (histograms, FLOPs, bytes) and refused ones.
        stub = connect(cls.server.target, keep_buffers=False)
        x = np.ones((2, 4, 8), dtype=np.float32)
        stub.LayerNorm(pb.LayerNormRequest(input=to_tensor(x)))
        stub.Attend(pb.AttendRequest(query=to_tensor(x), key=to_tensor(x),
                                     value=to_tensor(x)))
        try:
            stub.Attend(pb.AttendRequest(query=to_tensor(x)))  # no key
            raise AssertionError("Attend without a key succeeded")
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        stub.channel.close()
        with urllib.request.urlopen(
                f"http://127.0.0.1:{cls.metrics_port}/metrics",
                timeout=10) as response:
            cls.page = response.read().decode()
        cls.families = set(re.findall(r"^# TYPE (\S+) ", cls.page, re.M))
        cls.series = {re.match(r"[^{ ]+", line).group(0)
                      for line in cls.page.splitlines()
                      if line and not line.startswith("#")}

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()
        cls.workdir.cleanup()

    def promtool(self, *args, stdin=None):
        return subprocess.run([PROMTOOL, *args], input=stdin,
                              capture_output=True, text=True, cwd=RULES_DIR,
                              timeout=60)

    def test_page_has_every_family_with_samples(self):
        self.assertIn('attnserve_requests_total{rpc="Attend",'
                      'code="INVALID_ARGUMENT"} 1', self.page)
        for family in self.families:
            self.assertTrue(any(s == family or s.startswith(family + "_")
                                for s in self.series), family)

    def test_promtool_check_metrics(self):
        result = self.promtool("check", "metrics", stdin=self.page)
        self.assertEqual((result.returncode, result.stdout + result.stderr),
                         (0, ""))

    def test_promtool_check_rules(self):
        result = self.promtool("check", "rules", "alerts.yaml")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("SUCCESS: 8 rules found", result.stdout)

    def test_promtool_test_rules(self):
        result = self.promtool("test", "rules", "alerts_test.yaml")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("SUCCESS", result.stdout)

    def test_alert_rules_use_metrics_on_the_page(self):
        with open(os.path.join(RULES_DIR, "alerts.yaml")) as f:
            rules = [rule for group in yaml.safe_load(f)["groups"]
                     for rule in group["rules"]]
        self.assertEqual(len(rules), 8)
        for rule in rules:
            names = metric_names(rule["expr"])
            self.assertTrue(names, rule["alert"])
            self.assertLessEqual(names, self.series | SYNTHETIC,
                                 rule["alert"])

    def test_dashboard_uses_metrics_on_the_page(self):
        with open(DASHBOARD) as f:
            dashboard = json.load(f)
        queries = dashboard_queries(dashboard)
        self.assertGreater(len(queries), 15)
        used = set()
        for title, expr in queries:
            names = metric_names(expr)
            self.assertTrue(names, f"{title}: {expr}")
            self.assertLessEqual(names, self.series | SYNTHETIC,
                                 f"{title}: {expr}")
            used |= names
        # And everything the server reports is on the dashboard.
        for family in self.families:
            self.assertTrue(any(name == family or name.startswith(family + "_")
                                for name in used), family)
        ids = [panel["id"] for panel in dashboard["panels"]]
        self.assertEqual(len(ids), len(set(ids)))

    def test_metric_names_of_an_expression(self):
        self.assertEqual(
            metric_names('histogram_quantile(0.99, sum by (rpc, le) (rate('
                         'attnserve_queue_wait_seconds_bucket{job=~"$job", '
                         'code!="x{"}[$__rate_interval])))'),
            {"attnserve_queue_wait_seconds_bucket"})
        self.assertEqual(metric_names('absent(up{job="attnserve"})'), {"up"})
        self.assertEqual(metric_names("avg_over_time(foo[5m]) >= 1"),
                         {"foo"})


if __name__ == "__main__":
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        SERVER_BIN = sys.argv.pop(1)
    SERVER_BIN = SERVER_BIN or os.environ.get("ATTNSERVE_BIN", "")
    unittest.main()
