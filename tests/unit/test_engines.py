"""llmfleet.engines: one module per engine and one registry. The registry is what Ansible's literal choices
list; a profile plugged into the registry is all the plan, the READY rule and the wrapper need (adding an
engine, docs/engines.md); the package stays stdlib-only and Python 3.8 (it ships to nodes); and engine names
are written as literals in at most two package modules outside it."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import yaml

from llmfleet import engines
from llmfleet.engine import command, helpflags
from llmfleet.engine.plan import node_plan, wrapper_args
from llmfleet.engines.base import Profile

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "module_utils" / "llmfleet"
# An engine name, or a spelling of one, as a literal (a dict key, a comparison, a tuple, a default).
NAMES = {"sglang", "vllm", "vllm_pd", "custom", "vllm-pd", "vLLM", "SGLang"}


def _choices(path: Path, var: str) -> list:
    doc = yaml.safe_load(path.read_text())
    return doc["argument_specs"]["main"]["options"][var]["choices"]


def _module_doc(path: Path) -> dict:
    tree = ast.parse(path.read_text())
    doc = next(n.value.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "DOCUMENTATION")
    return yaml.safe_load(doc)


def test_the_argument_spec_choices_are_the_registry():
    assert _choices(ROOT / "roles/engine/meta/argument_specs.yml", "engine_profile") == list(engines.names())


def test_the_flags_module_documents_and_takes_the_registry_and_the_router():
    import llmfleet_engine_flags

    want = [*engines.names(), "router"]
    assert _module_doc(ROOT / "library/llmfleet_engine_flags.py")["options"]["profile"]["choices"] == want
    assert llmfleet_engine_flags.argument_spec()["profile"]["choices"] == want


def test_an_unknown_profile_names_the_known_ones():
    with pytest.raises(
        engines.UnknownProfile, match="engine_profile='tgi': choose one of sglang, vllm, vllm_pd, custom"
    ):
        engines.get("tgi")
    with pytest.raises(command.PlanError, match="choose one of sglang, vllm, vllm_pd, custom"):
        node_plan({"profile": "tgi", "model_path": "/m"}, 0)


def test_each_fact_has_one_owner():
    """The maps that were written several times: profile -> engine, the default port, the help arguments."""
    assert {n: engines.get(n).engine for n in engines.names()} == {
        "sglang": "sglang", "vllm": "vllm", "vllm_pd": "vllm", "custom": ""}  # fmt: skip
    assert {n: engines.get(n).default_port for n in engines.names()} == {
        "sglang": 30000, "vllm": 8000, "vllm_pd": 8000, "custom": 8000}  # fmt: skip
    assert {n: engines.help_args(n) for n in (*engines.names(), "router")} == {
        "sglang": ("--help",), "vllm": ("--help=all",), "vllm_pd": ("--help=all",), "custom": ("--help",),
        "router": ("--help",)}  # fmt: skip
    assert engines.kind("vllm 0.32.0+cpu") == "vllm" and engines.kind("router") == ""
    # vllm_pd is vLLM: the flag tables and log phrases are the engine's, once.
    assert engines.engine("vllm_pd") is engines.VLLM


def test_profiles_reach_ansible_as_plain_data():
    import json

    for name in engines.names():
        d = engines.get(name).as_dict()
        json.dumps(d)  # no patterns, functions or tuples left
        assert d["name"] == name


def test_the_role_asks_the_registry():
    """roles/engine/vars/main.yml writes no profile or engine name: it asks the profile."""
    text = (ROOT / "roles/engine/vars/main.yml").read_text()
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    for name in NAMES:
        assert f"'{name}'" not in code and f'"{name}"' not in code, name


FAKE = Profile(
    name="fake",
    engine="fake",
    label="Fake",
    default_port=9100,
    command=("fake-serve",),
    render=lambda spec, parts: [
        *parts["command"],
        "--model",
        parts["model"],
        "--tp",
        str(parts["tp"]),
        *(["--rank", str(parts["node_rank"]), "--of", str(parts["nnodes"])] if parts["nnodes"] > 1 else []),
        *parts["loader"],
        *parts["extra"],
        *parts["listen"],
    ],
    serving_re=r"Fake is serving",
    node_up_re={"graphs": r"Fake worker up", "eager": r"Fake worker up \(eager\)"},
    no_graph_flag="--fake-eager",
    secret_args=("--secret-env", "FAKE_API_KEY=api-key"),
    loader_threads=4,
)


@pytest.fixture
def fake_engine(monkeypatch):
    """A profile plugged into the registry, as a new engines/<name>.py and its registry line would."""
    monkeypatch.setitem(engines.PROFILES, FAKE.name, FAKE)
    return FAKE


def test_a_plugged_in_profile_gets_a_plan_and_a_wrapper(fake_engine):
    spec = {"profile": "fake", "model_path": "/m/rev", "tp": 2, "gpus_per_node": 2, "nnodes": 2,
            "head_addr": "10.0.0.1", "dist_port": 5000, "port": 9100, "extra_args": ["--x", "1"]}  # fmt: skip
    head, worker = node_plan(spec, 0), node_plan(spec, 1)
    assert head["argv"] == ["fake-serve", "--model", "/m/rev", "--tp", "2", "--rank", "0", "--of", "2",
                            "--x", "1", "--port", "9100"]  # fmt: skip
    assert head["ready"] == {"regex": "Fake is serving", "count": 1} and head["serves_api"]
    assert worker["ready"] == {"regex": "Fake worker up", "count": 1} and not worker["serves_api"]
    assert head["fanout"]["threads_per_rank"] == 4
    w = {"profile": "fake", "node": "n1", "head": True, "started": True, "api_key": True, "record": "r",
         "status": "s", "stop_timeout": 30, "extend_timeout": 60, "link_on": True, "link_head": "10.0.0.1:50082",
         "peers": ["n2"], "start_timeout": 300, "link_timeout": 5, "health": True, "health_interval": 30,
         "health_timeout": 20, "health_failures": 3, "ready_prompt": "q", "ready_expect": "a",
         "served_model_name": "m", "host": "", "port": 9100}  # fmt: skip
    out = wrapper_args(w, head)
    assert out["secret"] == ["--secret-env", "FAKE_API_KEY=api-key"]
    assert "http://127.0.0.1:9100" in out["health"] and out["router_exec"] == []
    assert out["exec"][-len(head["argv"]) - 1 :] == ["--", *head["argv"]]
    # The role's view of it (llmfleet_engine_profile) and the help check's.
    assert engines.get("fake").as_dict()["default_port"] == 9100 and "fake" in engines.names()
    assert helpflags.flag_known("--tp", {"--tp"}, "fake")


def test_custom_runs_the_operators_command():
    p = node_plan({"profile": "custom", "custom_argv": ["/opt/x", "--a"], "model_path": "/m"}, 0)
    assert p["argv"] == ["/opt/x", "--a"]
    assert p["ready"]["regex"] == engines.VLLM.serving_re + "|" + engines.SGLANG.serving_re


ENGINES_DIR = PKG / "engines"


@pytest.mark.parametrize("path", sorted(ENGINES_DIR.glob("*.py")), ids=lambda p: p.name)
def test_the_profiles_are_node_safe(path):
    """Python 3.8 syntax, postponed annotations, the standard library and each other only (no way back into the
    package: engines/ is the bottom layer everything else asks)."""
    src = path.read_text()
    tree = ast.parse(src, feature_version=(3, 8))
    assert any(isinstance(n, ast.ImportFrom) and n.module == "__future__" for n in tree.body), path.name
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                assert node.module.split(".")[0] in sys.stdlib_module_names | {"__future__"}, node.module
            else:
                assert node.level == 1, f"{path.name}: imports from outside engines/"
        elif isinstance(node, ast.Import):
            assert all(a.name.split(".")[0] in sys.stdlib_module_names for a in node.names)


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            out.add(id(body[0].value))
    return out


def files_naming_engines() -> list[str]:
    """Package modules outside engines/ with an engine name as a string literal (docstrings aside)."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        if ENGINES_DIR in path.parents:
            continue
        tree = ast.parse(path.read_text())
        skip = _docstrings(tree)
        hits = [
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in NAMES and id(n) not in skip
        ]
        if hits:
            found.append(str(path.relative_to(PKG)))
    return found


def test_engine_names_live_in_engines():
    assert len(files_naming_engines()) <= 2, files_naming_engines()


# The captured --help of each engine (tests/fixtures/engines/): the newest of each.
HELP = {"sglang": "sglang-0.5.23.serve-help.txt", "vllm": "vllm-0.33.0.serve-help-all.txt"}


@pytest.mark.parametrize("engine", sorted(HELP))
def test_every_flag_a_profile_writes_is_in_the_engines_own_help(engine):
    """The profile's flag tables (speculative, fit, NUMA, no-graph) name options the engine's own --help lists,
    read as the engine reads argv."""
    text = (ROOT / "tests" / "fixtures" / "engines" / HELP[engine]).read_text()
    options = helpflags.parse_help_options(text, engine)
    p = engines.get(engine)
    flags = {*p.spec_flags, *p.fit_argv_flags, *p.numa_flags, p.no_graph_flag}
    flags |= {v.split()[0] for v in p.fit_flags.values()}
    unknown = sorted(f for f in flags if not helpflags.flag_known(f, options, engine, allow_abbrev=False))
    assert not unknown, f"{HELP[engine]}: {unknown}"


def test_the_log_observer_reads_the_phrases_it_read_before_they_moved_into_the_profiles():
    from llmfleet.engine import logobserver

    before = (  # engine/logobserver.py's PHASE_PATTERNS until the phrases moved into the profiles
        ("dist_init", r"Init torch distributed begin|distributed_init_method="),
        ("dist_ready", r"Init torch distributed ends|rank \d+ in world size \d+ is assigned as"),
        ("loading", r"Load weight begin|Starting to load model"),
        ("loaded", r"Load weight end|Loading weights took|Model loading took"),
        ("warmup", r"Capture cuda graph begin|Capturing CUDA graphs"),
        ("warm", r"Capture cuda graph end|Graph capturing finished"),
        ("serving", r"The server is fired up and ready to roll!|Application startup complete"),
    )
    assert tuple((name, rx.pattern) for name, rx in logobserver.PHASE_PATTERNS) == before


def test_the_start_up_scan_keeps_its_rules_and_their_order():
    from llmfleet.engine import startscan

    before = [  # engine/startscan.py's RULES until each engine's rules moved into its profile
        "vllm-moe-default-config", "sglang-moe-default-config", "sglang-moe-other-triton-config",
        "block-fp8-default-config", "vllm-mamba-default-config", "vllm-attention-backend-block-size",
        "vllm-flash-attention-fallback", "vllm-fp8-marlin-fallback", "vllm-custom-allreduce-disabled",
        "transformers-backend-fallback", "sglang-deepgemm-jit-precompile", "sglang-cuda-graph-disabled",
        "vllm-eager-mode", "vllm-cudagraph-memory-unprofiled", "libcuda-unversioned-missing",
    ]  # fmt: skip
    assert [r.id for r in startscan.RULES] == before
    for e in engines.engines():
        assert {r.engine for r in engines.get(e).start_rules} == {e}
