import os

import pytest

from llmfleet import __version__, nodeinfo


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        ("MemTotal:       24683652 kB\nMemFree:  1 kB\n", "MemTotal", 24683652),
        ("MemFree:  1 kB\nMemTotal: 7 kB\n", "MemTotal", 7),
        ("MemFree:  1 kB\n", "MemTotal", 0),
        ("", "MemTotal", 0),
        ("HugePages_Total:       4\n", "HugePages_Total", 4),
    ],
)
def test_meminfo_kib(text, key, expected):
    assert nodeinfo.meminfo_kib(text, key) == expected


MOUNTINFO = """\
22 1 0:20 / / rw,relatime - overlay overlay rw
40 22 254:0 /var/lab/shared /mnt/shared ro,relatime - ext4 /dev/vda rw
41 22 254:0 /var/lab/nvme /mnt/nvme rw,relatime - ext4 /dev/vda rw
42 40 0:50 / /mnt/shared rw,relatime - nfs srv:/x rw
"""


def test_mount_options_takes_the_topmost_mount():
    assert nodeinfo.mount_options(MOUNTINFO, "/mnt/nvme") == ["rw", "relatime"]
    assert nodeinfo.mount_options(MOUNTINFO, "/mnt/shared") == ["rw", "relatime"]  # 42 stacks on 40
    assert nodeinfo.mount_options(MOUNTINFO, "/nope") is None


def _dev(root, bdf, vendor, cls):
    d = root / "bus/pci/devices" / bdf
    d.mkdir(parents=True)
    (d / "vendor").write_text(vendor + "\n")
    (d / "class").write_text(cls + "\n")


def test_nvidia_gpus_from_sysfs(tmp_path):
    _dev(tmp_path, "0000:18:00.0", "0x10de", "0x030200")  # H20 / H200: 3D controller
    _dev(tmp_path, "0000:03:00.0", "0x10de", "0x030000")  # VGA-class NVIDIA GPU
    _dev(tmp_path, "0000:18:00.1", "0x10de", "0x040300")  # NVIDIA HD audio function: not a GPU
    _dev(tmp_path, "0000:1a:00.0", "0x15b3", "0x020700")  # Mellanox CX-7 (InfiniBand class)
    _dev(tmp_path, "0000:00:02.0", "0x8086", "0x030000")  # Intel VGA
    assert nodeinfo.nvidia_gpus(str(tmp_path)) == ["0000:03:00.0", "0000:18:00.0"]
    assert nodeinfo.nvidia_gpus(str(tmp_path / "missing")) == []


def test_gather_from_fake_proc(tmp_path):
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    (proc / "self").mkdir()
    (proc / "sys/kernel/random").mkdir(parents=True)
    (proc / "1/environ").write_bytes(b"PATH=/bin\0container=labnode\0")
    (proc / "1/comm").write_text("systemd\n")
    (proc / "meminfo").write_text("MemTotal: 2048 kB\n")
    (proc / "sys/kernel/random/boot_id").write_text("b00t\n")
    (proc / "self/mountinfo").write_text(f"40 22 254:0 /x {tmp_path} ro,relatime - ext4 /dev/vda rw\n")
    info = nodeinfo.gather(
        proc_root=str(proc), sys_root=str(tmp_path / "sys"), nvme=str(tmp_path), shared=str(tmp_path)
    )
    assert info["pid1"] == "systemd"
    assert info["container"] == "labnode"
    assert info["boot_id"] == "b00t"
    assert info["mem_total_bytes"] == 2048 * 1024
    assert info["gpus"] == []
    assert info["shared"] == {"path": str(tmp_path), "mounted": True, "read_only": True}
    assert info["nvme"]["present"] and info["nvme"]["total_bytes"] >= info["nvme"]["free_bytes"] > 0
    assert info["llmfleet_version"] == __version__


def test_disk_missing_path_is_reported_not_raised(tmp_path):
    d = nodeinfo.disk(os.fspath(tmp_path / "nope"))
    assert d["present"] is False and "No such file" in d["error"]


def test_read_text_strips_and_falls_back_to_the_default(tmp_path):
    (tmp_path / "numa_node").write_text("1\n")
    (tmp_path / "vendor").write_bytes(b"0x10de\xff\n")  # undecodable bytes are replaced, not raised
    assert nodeinfo.read_text(os.fspath(tmp_path / "numa_node")) == "1"
    assert nodeinfo.read_text(os.fspath(tmp_path / "vendor")) == "0x10de\ufffd"
    assert nodeinfo.read_text(os.fspath(tmp_path / "missing")) == ""
    assert nodeinfo.read_text(os.fspath(tmp_path / "missing"), "-1") == "-1"
    assert nodeinfo.read_text(os.fspath(tmp_path), "-1") == "-1"  # a directory is unreadable too
