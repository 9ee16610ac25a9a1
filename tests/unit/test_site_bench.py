"""bench/site_bench.py: which tasks count as work, and the per-role table adds up to the run's wall time."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("site_bench", Path(__file__).parents[2] / "bench" / "site_bench.py")
site_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(site_bench)


def row(role, action, seconds, play="p"):
    return {"play": play, "role": role, "action": action, "task": "t", "seconds": seconds}


def test_only_waits_on_copies_ranks_and_the_engine_are_work():
    assert site_bench.is_work(row("model_stage", "llmfleet_job_wait", 1))
    assert site_bench.is_work(row("engine", "llmfleet_engine_ready", 1))
    assert site_bench.is_work(row("acceptance", "ansible.builtin.command", 1))
    assert not site_bench.is_work(row("base", "ansible.builtin.command", 1))
    assert not site_bench.is_work(row("engine", "ansible.builtin.template", 1))


def test_the_table_adds_up_to_the_wall_time():
    rows = [row("base", "ansible.builtin.file", 2), row("model_stage", "llmfleet_job_wait", 6),
            row("model_stage", "ansible.builtin.stat", 1), row("", "ansible.builtin.debug", 0.5, play="Stop")]  # fmt: skip
    table = site_bench.per_role(rows, wall=10.5)
    by = {d["role"]: d for d in table}
    assert by["model_stage"]["work"] == 6 and by["model_stage"]["overhead"] == 1
    assert by["(Stop)"]["overhead"] == 0.5
    assert by["(ansible-playbook start-up, parsing, play set-up)"]["wall"] == 1
    total = table[-1]
    assert total["wall"] == 10.5 and total["work"] == 6 and total["overhead"] == 4.5
    assert "goal < 20%: not met" in site_bench.render(table, "forks = 64", "today")
