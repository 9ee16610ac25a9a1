import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmfleet import __version__, cli


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"llmfleet {__version__}"


def test_no_command_is_usage_error(capsys):
    assert cli.main([]) == 2
    assert "usage: llmfleet" in capsys.readouterr().err


def test_unknown_option_is_usage_error():
    with pytest.raises(SystemExit) as e:
        cli.main(["node-info", "--bogus"])
    assert e.value.code == 2


def test_node_info_json(capsys, tmp_path):
    assert cli.main(["node-info", "--json", "--nvme", str(tmp_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["nvme"]["path"] == str(tmp_path)
    assert info["llmfleet_version"] == __version__


def test_console_script_and_module_entry_points():
    out = subprocess.run([sys.executable, "-m", "llmfleet", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"llmfleet {__version__}"
    script = Path(sys.executable).parent / "llmfleet"  # the console script pip installed
    exe = subprocess.run([str(script), "--version"], capture_output=True, text=True, check=True)
    assert exe.stdout == out.stdout


def test_stage_cli_with_progress(tmp_path):
    from tests.helpers.ckpt import make_checkpoint

    src = make_checkpoint(tmp_path / "src")
    rev = "c" * 40
    base = [
        sys.executable,
        "-m",
        "llmfleet",
        "stage",
        str(src),
        "--model",
        "m",
        "--revision",
        rev,
        "--root",
        str(tmp_path / "nvme"),
    ]
    chk = subprocess.run([*base, "--check"], capture_output=True, text=True, check=False)
    assert chk.returncode == 0 and "absent: would copy 7 files" in chk.stdout
    assert not (tmp_path / "nvme").exists()
    cp = subprocess.run([*base, "--json"], capture_output=True, text=True, check=False)
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout)["bytes_copied"] > 0
    assert "building the manifest" in cp.stderr and "100.0%" in cp.stderr and "published" in cp.stderr
    again = subprocess.run([*base, "--json"], capture_output=True, text=True, check=False)
    assert json.loads(again.stdout)["bytes_copied"] == 0
    bad = subprocess.run(
        [*base[:-2], "--root", str(tmp_path / "nvme"), "--revision", "main"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 1 and "40-hex" in bad.stderr
