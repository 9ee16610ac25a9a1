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
    assert bad.returncode == 2 and "40-hex" in bad.stderr  # bad input, refused before reading anything


# ---- bad input: one clear line naming the flag and the fix, exit 2, never a traceback ---------------

REV = "c" * 40
STAGE = ["stage", "{ck}", "--model", "m", "--revision", REV, "--root", "{tmp}/nvme", "--check"]
BAD_USAGE = [
    # (label, argv ({ck}: a good checkpoint, {tmp}: an empty dir, {roce}: a RoCE sysfs tree), text in stderr)
    ("override without =", ["topology", "--sysfs-root", "{tmp}", "--override", "X"], "argument --override: 'X' is not VAR=VALUE"),
    ("override without a name", ["topology", "--sysfs-root", "{tmp}", "--override", "=3"], "'=3' is not VAR=VALUE"),
    ("override name with a space", ["topology", "--sysfs-root", "{tmp}", "--override", "A B=1"], "is not VAR=VALUE"),
    ("override GID index not a number", ["topology", "--sysfs-root", "{tmp}", "--override", "NCCL_IB_GID_INDEX=three"],
     "--override NCCL_IB_GID_INDEX=three: not a GID table index"),
    ("override GID index not a number, RoCE node", ["topology", "--sysfs-root", "{roce}", "--override", "NCCL_IB_GID_INDEX=x"],
     "--override NCCL_IB_GID_INDEX=x: not a GID table index"),
    ("override HCA port not a number", ["topology", "--sysfs-root", "{roce}", "--override", "NCCL_IB_HCA=mlx5_0:x"],
     "'mlx5_0:x' is not HCA[:PORT]"),
    ("override HCA absent", ["topology", "--sysfs-root", "{roce}", "--override", "NCCL_IB_HCA=mlx5_9"],
     "--override NCCL_IB_HCA: mlx5_9:1 does not exist here"),
    ("address without =", ["topology", "--sysfs-root", "{tmp}", "--address", "eth0"], "argument --address: 'eth0' is not IFNAME=IPV4"),
    ("address not IPv4", ["topology", "--sysfs-root", "{tmp}", "--address", "eth0=10.1.1"], "'10.1.1' is not an IPv4 address"),
    ("node ip not IPv4", ["topology", "--sysfs-root", "{tmp}", "--node-ip", "node1"], "argument --node-ip: 'node1' is not an IPv4"),
    ("sysfs root missing", ["topology", "--sysfs-root", "{tmp}/nope"], "--sysfs-root {tmp}/nope: not a directory"),
    ("manifest -o in a missing dir", ["checkpoint", "manifest", "{ck}", "-o", "{tmp}/missing/dir/m.json"],
     "-o {tmp}/missing/dir/m.json: directory {tmp}/missing/dir does not exist: create it first"),
    ("manifest -o a directory", ["checkpoint", "manifest", "{ck}", "-o", "{tmp}"], "-o {tmp} names a directory: give a file name"),
    ("manifest -o ends with /", ["checkpoint", "manifest", "{ck}", "-o", "{tmp}/new/"], "names a directory"),
    ("manifest negative threads", ["checkpoint", "manifest", "{ck}", "--threads", "-1"], "argument --threads: -1 is too small"),
    ("manifest bad revision", ["checkpoint", "manifest", "{ck}", "--revision", "main"], "'main' is not a 40-hex commit id"),
    ("verify zero threads", ["checkpoint", "verify", "{ck}", "--threads", "0"], "argument --threads: 0 is too small"),
    ("verify threads not a number", ["checkpoint", "verify", "{ck}", "--threads", "four"], "'four' is not a whole number"),
    ("stage negative keep", [*STAGE, "--keep-revisions", "-1"], "argument --keep-revisions: -1 is too small: give a number >= 1"),
    ("stage zero keep", [*STAGE, "--keep-revisions", "0"], "argument --keep-revisions: 0 is too small"),
    ("stage zero threads", [*STAGE, "--threads", "0"], "argument --threads: 0 is too small"),
    ("stage branch revision", [*STAGE[:5], "main", *STAGE[6:]], "argument --revision: 'main' is not a 40-hex commit id"),
    ("stage model escaping the root", [*STAGE[:2], "--model", "../x", *STAGE[4:]], "--model: model name '../x'"),
    ("stage missing manifest", [*STAGE, "--manifest", "{tmp}/nope.json"], "--manifest {tmp}/nope.json: no such file"),
    ("stage missing source", ["stage", "{tmp}/nope", *STAGE[2:]], "{tmp}/nope: not a directory"),
]  # fmt: skip


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    from tests.helpers.ckpt import make_checkpoint
    from tests.helpers.fakesys import hgx_h20

    base = tmp_path_factory.mktemp("cli")
    hgx_h20(base / "roce", [f"10.10.{n}.11" for n in range(8)])
    return {"ck": str(make_checkpoint(base / "ck")), "roce": str(base / "roce")}


def run_main(argv):
    """cli.main in-process: (exit status, stdout, stderr); argparse errors exit through SystemExit."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(("label", "argv", "text"), BAD_USAGE, ids=[c[0] for c in BAD_USAGE])
def test_bad_input_is_one_clear_line_and_exit_2(trees, tmp_path, label, argv, text):
    subst = {**trees, "tmp": str(tmp_path)}
    rc, out, err = run_main([a.format(**subst) for a in argv])
    assert rc == 2, (out, err)
    assert text.format(**subst) in err
    assert "Traceback" not in err
    assert not (tmp_path / "nvme").exists() and not list(tmp_path.rglob("*.tmp"))  # refused before doing anything


def test_manifest_output_is_checked_before_hashing(trees, tmp_path, monkeypatch):
    import llmfleet.stage.manifest

    def hashing(*a, **k):
        raise AssertionError("hashed the revision before checking -o")

    monkeypatch.setattr(llmfleet.stage.manifest, "build_manifest", hashing)
    rc, _, err = run_main(["checkpoint", "manifest", trees["ck"], "-o", str(tmp_path / "no/such/dir/m.json")])
    assert rc == 2 and "does not exist" in err


def _entry(kind):
    if kind == "script":
        return [str(Path(sys.executable).parent / "llmfleet")]  # the console script pip installed
    return [sys.executable, "-m", kind]


@pytest.mark.parametrize("kind", ["script", "llmfleet", "llmfleet.cli"])
def test_every_documented_entry_point_runs_the_cli(kind):
    """`python -m llmfleet.cli exec -- false` used to import cli.py and exit 0, running nothing."""
    ver = subprocess.run([*_entry(kind), "--version"], capture_output=True, text=True, check=False, timeout=60)
    assert ver.returncode == 0 and ver.stdout.strip() == f"llmfleet {__version__}"
    usage = subprocess.run([*_entry(kind)], capture_output=True, text=True, check=False, timeout=60)
    assert usage.returncode == 2 and "usage: llmfleet" in usage.stderr
    failed = subprocess.run(
        [*_entry(kind), "exec", "--", "false"], capture_output=True, text=True, check=False, timeout=60
    )
    assert failed.returncode == 1 and "llmfleet exec" in failed.stderr, failed.stderr


def test_topology_text_says_which_hcas_are_rails(tmp_path, capsys):
    from tests.helpers.fakesys import dgx_h100_ib

    dgx_h100_ib(tmp_path)
    assert cli.main(["topology", "--sysfs-root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GPU1 0000:25:00.0  numa=0 nearest=mlx5_1 (PXB) rail=mlx5_1" in out
    assert "mlx5_8:1 ACTIVE InfiniBand" in out and out.split("mlx5_8:1", 1)[1].split("\n", 1)[0].endswith("not-a-rail")
    assert "not a rail: mlx5_8 (no GPU on its PCIe switch or root complex" in out
    assert "mlx5_8" not in out.split("NCCL_IB_HCA=", 1)[1].split("\n", 1)[0]
