"""A CLI result that says "fine" must have read something: a missing unit, an empty or unreadable log, a file that is
no /metrics text, a malformed termination record and a stamp path whose directories do not exist are errors (exit 2,
naming the unit, file or flag and the fix), never a clean result; nothing creates directories for --stamp."""

from __future__ import annotations

import argparse
import io
import json
import os
import stat
import sys

import pytest

from llmfleet import cli
from llmfleet.engine import precompile, startscan

VLLM_METRICS = (
    "# TYPE vllm:spec_decode_num_drafts_total counter\n"
    'vllm:spec_decode_num_drafts_total{model_name="m",engine="0"} 400.0\n'
    'vllm:spec_decode_num_draft_tokens_total{model_name="m",engine="0"} 1200.0\n'
    'vllm:spec_decode_num_accepted_tokens_total{model_name="m",engine="0"} 900.0\n'
)


def _cli(capsys, *argv):
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---- startscan ------------------------------------------------------------------------------------------------------


@pytest.fixture
def systemd(tmp_path, monkeypatch):
    """Test doubles for systemctl and journalctl (this host runs no systemd; the lab's nodes do): they answer as
    systemd 252 does - `systemctl show` of an unknown unit exits 0 with LoadState=not-found, and journalctl -q of an
    empty selection prints nothing. SYSTEMD_UNITS names the units it knows; JOURNAL is what journalctl prints."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "systemctl").write_text(
        '#!/bin/sh\nunit=""; for a in "$@"; do unit="$a"; done\n'
        'case " $SYSTEMD_UNITS " in *" $unit "*) echo LoadState=loaded; echo InvocationID=0123abcd ;;\n'
        "*) echo LoadState=not-found; echo InvocationID= ;; esac\n"
    )
    (bin_ / "journalctl").write_text('#!/bin/sh\nprintf "%s" "$JOURNAL"\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    monkeypatch.setenv("SYSTEMD_UNITS", "llmfleet-demo.service")
    return monkeypatch


def test_startscan_of_a_unit_systemd_does_not_know_is_an_error(systemd, capsys):
    systemd.setenv("JOURNAL", "")
    rc, out, err = _cli(capsys, "startscan", "--unit", "llmfleet-nosuch.service")
    assert rc == 2 and out == ""
    assert "--unit llmfleet-nosuch.service: systemd has no such unit (LoadState=not-found)" in err
    assert "systemctl list-units 'llmfleet-*'" in err


def test_startscan_of_a_unit_whose_journal_gives_nothing_is_an_error(systemd, capsys):
    systemd.setenv("JOURNAL", "")  # not started yet, or this user may not read the journal
    rc, _, err = _cli(capsys, "startscan", "--unit", "llmfleet-demo.service")
    assert rc == 2 and "the journal holds no line of its current start" in err and "systemd-journal" in err
    systemd.setenv("JOURNAL", "-- No entries --\n")
    assert _cli(capsys, "startscan", "--unit", "llmfleet-demo.service")[0] == 2


def test_startscan_of_a_unit_with_lines_scans_them(systemd, capsys):
    systemd.setenv("JOURNAL", "INFO engine started\n")
    rc, out, _ = _cli(capsys, "startscan", "--unit", "llmfleet-demo.service")
    assert rc == 0 and "no known fall-back line" in out


def test_startscan_of_an_empty_log_is_an_error(tmp_path, capsys, monkeypatch):
    empty = tmp_path / "engine.log"
    empty.write_text("\n\n")
    rc, out, err = _cli(capsys, "startscan", str(empty))
    assert rc == 2 and out == "" and f"{empty} is empty: nothing to scan" in err
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    rc, _, err = _cli(capsys, "startscan", "-")
    assert rc == 2 and "standard input is empty" in err


def test_startscan_when_systemd_cannot_be_asked_says_so():
    def broken(argv, **kw):
        return argparse.Namespace(returncode=1, stdout="", stderr="Failed to connect to bus: Host is down")

    with pytest.raises(startscan.ScanInputError, match=r"cannot ask systemd about it \(Failed to connect to bus"):
        startscan.unit_journal("llmfleet-demo.service", run=broken)


# ---- specdecode -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"\x00\x01garbage, not metrics\n", "holds no Prometheus sample line"),
        (b"<html><body>502 Bad Gateway</body></html>\n", "holds no Prometheus sample line"),
        (b"", "is empty"),
        (b"vllm:spec_decode_num_drafts_total NaN\n", "has vllm:spec_decode_num_drafts_total = nan"),
        (b"vllm:spec_decode_num_drafts_total -5\n", "has vllm:spec_decode_num_drafts_total = -5.0"),
    ],
    ids=["garbage", "html", "empty", "nan-counter", "negative-counter"],
)
def test_specdecode_of_a_file_that_is_no_metrics_text_is_an_error(tmp_path, capsys, content, said):
    f = tmp_path / "metrics.txt"
    f.write_bytes(content)
    rc, out, err = _cli(capsys, "specdecode", str(f), "--steps", "3")
    assert rc == 2 and out == "" and f"llmfleet specdecode: {f} {said}" in err and "Traceback" not in err


def test_specdecode_of_real_metrics_still_judges(tmp_path, capsys):
    f = tmp_path / "metrics.txt"
    f.write_text(VLLM_METRICS)
    rc, out, _ = _cli(capsys, "specdecode", str(f), "--steps", "3")
    assert rc == 0 and out.startswith("speculative decoding: pays")
    f.write_text("vllm:num_requests_running 0\n")  # a /metrics without spec-decode figures: read, not judged
    rc, out, _ = _cli(capsys, "specdecode", str(f), "--steps", "3")
    assert rc == 0 and "not judged" in out


@pytest.mark.parametrize("steps", ["-1", "0", "two"])
def test_specdecode_steps_below_one_is_a_usage_error(tmp_path, capsys, steps):
    f = tmp_path / "metrics.txt"
    f.write_text(VLLM_METRICS)
    with pytest.raises(SystemExit) as e:
        cli.main(["specdecode", str(f), "--steps", steps])
    assert e.value.code == 2 and "argument --steps" in capsys.readouterr().err


# ---- why ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("record", "said"),
    [
        ({"exit_code": "1"}, "exit_code is '1' (str), not int"),
        ({"started_at": 1.0, "ended_at": 9.0, "verdict": "exit-code", "exit_code": "1"}, "exit_code is '1'"),
        (
            {
                "started_at": 1.0,
                "ended_at": 9.0,
                "verdict": "stopped-by-operator",
                "exit_code": 0,
                "stop_requested": "false",
            },
            "stop_requested is 'false' (str), not bool",
        ),
        ({"exit_code": 1}, "not a whole termination record: no verdict or ended_at"),
        ([], "not a termination record (a JSON object)"),
        ("{not json", "not valid JSON"),
    ],
    ids=["exit-code-string", "exit-code-string-with-verdict", "stop-requested-string", "no-verdict", "list", "json"],
)
def test_why_never_says_no_failure_for_a_malformed_record(tmp_path, capsys, record, said):
    node = tmp_path / "gpu-a01"
    node.mkdir()
    path = node / "termination-llmfleet-demo.service.json"
    path.write_text(record if isinstance(record, str) else json.dumps(record))
    rc, out, err = _cli(capsys, "why", "--bundle", str(tmp_path))
    assert rc == 2 and "NO FAILURE" not in out and "NOT JUDGED" in out
    assert f"{path}: {said}" in err and "collect the bundle again" in err


def test_why_with_a_failure_elsewhere_still_names_it(tmp_path, capsys):
    for node, rec in (("gpu-a01", {"exit_code": "1"}),
                      ("gpu-a02", {"started_at": 1.0, "ended_at": 9.0, "verdict": "exit-code", "exit_code": 1})):  # fmt: skip
        (tmp_path / node).mkdir()
        (tmp_path / node / "termination-llmfleet-demo.service.json").write_text(json.dumps(rec))
    rc, out, _ = _cli(capsys, "why", "--bundle", str(tmp_path))
    assert rc == 1 and "FAILED: 1 unit(s) failed; first: gpu-a02" in out and "exit_code is '1'" in out


def test_why_of_a_unit_with_nothing_readable_is_not_judged(tmp_path, capsys):
    node = tmp_path / "gpu-a01"
    node.mkdir()
    (node / "journal-llmfleet-demo.service.txt").write_text("")
    rc, out, err = _cli(capsys, "why", "--bundle", str(tmp_path))
    assert rc == 2 and "NO FAILURE" not in out and "nothing to judge it from" in err


# ---- precompile --stamp ---------------------------------------------------------------------------------------------


def _precompile(stamp, *cmd):
    return precompile.run(argparse.Namespace(stamp=str(stamp), cmd=["--", *cmd]))


def test_precompile_creates_no_directory_for_its_stamp(tmp_path, capsys):
    stamp = tmp_path / "nonexistent" / "dir" / "stamp"
    assert _precompile(stamp, sys.executable, "-c", "print('compiled')") == 2
    assert not (tmp_path / "nonexistent").exists()
    err = capsys.readouterr().err
    assert f"--stamp {stamp}: neither {stamp.parent} nor {stamp.parent.parent} exists" in err
    assert "engine_cache_root" in err


def test_precompile_does_not_run_the_compile_for_a_stamp_it_cannot_use(tmp_path, capsys):
    ran = tmp_path / "ran"
    (tmp_path / "fp").mkdir()
    stamp = tmp_path / "fp" / "stamp"
    stamp.mkdir()  # a directory is not a stamp: never read as done
    assert _precompile(stamp, sys.executable, "-c", f"open({str(ran)!r}, 'w')") == 2
    assert not ran.exists() and "is not a regular file" in capsys.readouterr().err
    stamp.rmdir()
    os.mkfifo(stamp)
    assert _precompile(stamp, sys.executable, "-c", f"open({str(ran)!r}, 'w')") == 2 and not ran.exists()


def test_precompile_an_empty_stamp_compiles_again_and_the_stamp_is_written_whole(tmp_path):
    (tmp_path / "fp").mkdir()
    stamp = tmp_path / "fp" / "stamp"
    stamp.write_text("")  # a write cut short
    assert _precompile(stamp, sys.executable, "-c", "print('compiled')") == 0
    assert stamp.read_text().startswith("compiled in ") and stat.S_ISREG(os.lstat(stamp).st_mode)
    assert sorted(p.name for p in stamp.parent.iterdir()) == ["stamp"]  # no temporary file left


def test_precompile_without_a_command_is_a_usage_error(tmp_path, capsys):
    assert _precompile(tmp_path / "stamp") == 2
    assert "give the precompile command after --stamp STAMP --" in capsys.readouterr().err
