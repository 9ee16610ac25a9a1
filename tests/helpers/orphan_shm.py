"""What a killed engine can leave on a lab node: /dev/shm entries no live process maps (RAM lost until the node
reboots). By inode: glibc maps a new semaphore under a temporary name, so its creator's maps never name it. A shell
command for the node (run over SSH), printing the orphaned paths separated by spaces."""

ORPHAN_SHM = (
    "sudo -n python3 -c 'import glob, os\n"
    "mapped = set()\n"
    'for maps in glob.glob("/proc/[0-9]*/maps"):\n'
    "    try:\n"
    '        mapped |= {int(ln.split()[4]) for ln in open(maps) if " /dev/shm/" in ln}\n'
    "    except (OSError, IndexError, ValueError):\n"
    "        pass\n"
    'print(" ".join(p for p in sorted(glob.glob("/dev/shm/*")) if os.lstat(p).st_ino not in mapped))\''
)
