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
