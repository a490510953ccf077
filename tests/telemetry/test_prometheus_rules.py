"""The Prometheus rules shipped under examples/monitoring/: valid (`promtool check rules`), every rule unit-tested
(`promtool test rules`), and their names and labels those the exporter writes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml
from _tools import tool

from lightning_accel.telemetry.prometheus import GPU_LABELS, PROMETHEUS_METRICS

MONITORING = Path(__file__).resolve().parents[2] / "examples" / "monitoring"


def _rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load((MONITORING / "rules.yml").read_text())["groups"] for rule in group["rules"]
    ]


def test_promtool_checks_the_rules_and_passes_their_unit_tests() -> None:
    promtool = tool("promtool")
    checked = subprocess.run(
        [promtool, "check", "rules", "rules.yml"], cwd=MONITORING, capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0 and f"SUCCESS: {len(_rules())} rules found" in checked.stdout, checked
    tested = subprocess.run(
        [promtool, "test", "rules", "rules_test.yml"], cwd=MONITORING, capture_output=True, text=True, timeout=60
    )
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_every_rule_has_a_unit_test() -> None:
    tests = yaml.safe_load((MONITORING / "rules_test.yml").read_text())["tests"]
    alerts = {case["alertname"] for test in tests for case in test.get("alert_rule_test", [])}
    fired = {case["alertname"] for test in tests for case in test.get("alert_rule_test", []) if case["exp_alerts"]}
    exprs = " ".join(case["expr"] for test in tests for case in test.get("promql_expr_test", []))
    for rule in _rules():
        if "alert" in rule:
            assert rule["alert"] in alerts & fired, f"{rule['alert']}: no test where it fires"
        else:
            assert rule["record"] in exprs, f"{rule['record']}: no promql_expr_test reads it"


def test_the_rules_read_series_and_labels_the_exporter_writes() -> None:
    written = {metric.name for metric in PROMETHEUS_METRICS}
    labels = {label for metric in PROMETHEUS_METRICS for label in metric.labels} | {"job", "instance"}
    recorded = {rule["record"] for rule in _rules() if "record" in rule}
    for rule in _rules():
        for name in re.findall(r"\b(accel_[a-z_]+)", rule["expr"]):
            assert name in written, f"{rule.get('alert') or rule['record']} reads {name}, which no job exports"
        for name in re.findall(r"\b(accel:[a-z_:]+)", rule["expr"]):
            assert name in recorded, f"{name} is read but not recorded"
        for label in re.findall(r"by \(([^)]*)\)", rule["expr"]):
            assert {part.strip() for part in label.split(",")} <= labels, label
    assert {"host", "gpu", "uuid", "run_id"} <= set(GPU_LABELS)
