#!/bin/bash
# PID 1 of a lab node's new pid/mount/uts/ipc/cgroup namespaces (started by labctl.py through
# `ip netns exec NS unshare ...`). Builds the node's root filesystem view and execs a real
# systemd as PID 1. Everything mounted here lives only in this node's private mount namespace,
# so the host never sees (or has to clean up) any of it.
#
# usage: node-init.sh NODE_DIR HOSTNAME SHARED_DIR PROJECT_DIR
# SHARED_DIR is mounted read-only at /mnt/shared (the model source) and SHARED_DIR-rw read-write at
# /mnt/shared-rw (the writable area of the same storage: reader leases, manifest cache).
set -euo pipefail

node_dir=$1 host=$2 shared=$3 project=$4
rt=$node_dir/rt
R=$rt/root

mount --make-rprivate /

# Overlay root: the host's / is the read-only lower layer, node writes land in a tmpfs upper.
mkdir -p "$rt"
mount -t tmpfs -o mode=0755,size=4g "llmfleet-$host" "$rt"
mkdir -p "$rt/upper" "$rt/work" "$R"
mount -t overlay overlay -o "lowerdir=/,upperdir=$rt/upper,workdir=$rt/work" "$R"

mount -t proc proc "$R/proc"
# /proc/sys read-only except net (otherwise the node's systemd-sysctl rewrites host sysctls).
mount --bind "$R/proc/sys" "$R/proc/sys"
mount -o remount,bind,ro "$R/proc/sys"
mount --bind "$R/proc/sys/net" "$R/proc/sys/net"
mount -o remount,bind,rw "$R/proc/sys/net"
# sysfs read-only (mounted from inside the netns: class/net shows this node's interfaces).
mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$R/sys"
mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 "$R/sys/fs/cgroup"

mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs "$R/run"
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$R/tmp"

# Minimal /dev.
mount -t tmpfs -o mode=0755,nosuid tmpfs "$R/dev"
for d in null zero full random urandom tty; do
  touch "$R/dev/$d"
  mount --bind "/dev/$d" "$R/dev/$d"
done
mkdir -p "$R/dev/pts" "$R/dev/shm" "$R/dev/mqueue"
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620,gid=5 devpts "$R/dev/pts"
ln -s pts/ptmx "$R/dev/ptmx"
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$R/dev/shm"
mount -t mqueue mqueue "$R/dev/mqueue"
ln -s /proc/self/fd "$R/dev/fd"
ln -s /proc/self/fd/0 "$R/dev/stdin"
ln -s /proc/self/fd/1 "$R/dev/stdout"
ln -s /proc/self/fd/2 "$R/dev/stderr"
touch "$node_dir/console.log" "$R/dev/console"
mount --bind "$node_dir/console.log" "$R/dev/console"

# Node "disks": private NVMe, shared storage read-only, the project (and its venv) read-only.
mkdir -p "$R/mnt/nvme" "$R/mnt/shared" "$R/mnt/shared-rw" "$R$project"
# node_exporter's textfile directory, as its package leaves it (llmfleet_metrics_dir).
install -d -m 0755 "$R/var/lib/node_exporter/textfile_collector"
mount --bind "$node_dir/nvme" "$R/mnt/nvme"
mount --bind "$shared" "$R/mnt/shared"
mount -o remount,bind,ro "$R/mnt/shared"
mount --bind "${shared}-rw" "$R/mnt/shared-rw"
mount --bind "$project" "$R$project"
mount -o remount,bind,ro "$R$project"

# Identity.
echo "$host" >"$R/etc/hostname"
systemd-id128 new >"$R/etc/machine-id"
cp "$node_dir/hosts" "$R/etc/hosts"
# No DNS server is reachable from the lab subnet: answer "no" at once (127.0.0.1:53 refuses)
# instead of letting every reverse lookup hang for the resolver timeout.
rm -f "$R/etc/resolv.conf"
printf 'nameserver 127.0.0.1\noptions timeout:1 attempts:1\n' >"$R/etc/resolv.conf"
install -d -m 0700 "$R/root/.ssh"
# The project venv's interpreter may live under the host's /root (pyenv): let service users (the
# engine unit's User=) traverse it inside the node; the host's /root is untouched (overlay upper).
chmod 0711 "$R/root"
install -m 0600 "$node_dir/authorized_keys" "$R/root/.ssh/authorized_keys"
# The site's operator account, as on a real cluster: key login, passwordless sudo (the lab inventory
# connects as `ops` with become). Password '*' (not '!'): sshd without PAM refuses locked accounts.
if ! chroot "$R" getent passwd ops >/dev/null; then
  chroot "$R" useradd --create-home --shell /bin/bash --user-group --password '*' ops
fi
install -d -m 0700 -o "$(chroot "$R" id -u ops)" -g "$(chroot "$R" id -g ops)" "$R/home/ops/.ssh"
install -m 0600 -o "$(chroot "$R" id -u ops)" -g "$(chroot "$R" id -g ops)" \
  "$node_dir/authorized_keys" "$R/home/ops/.ssh/authorized_keys"
printf 'ops ALL=(ALL:ALL) NOPASSWD: ALL\n' >"$R/etc/sudoers.d/llmfleet-lab-ops"
chmod 0440 "$R/etc/sudoers.d/llmfleet-lab-ops"
rm -f "$R"/etc/ssh/ssh_host_*
install -m 0600 "$node_dir/ssh_host_ed25519_key" "$R/etc/ssh/ssh_host_ed25519_key"
install -m 0644 "$node_dir/ssh_host_ed25519_key.pub" "$R/etc/ssh/ssh_host_ed25519_key.pub"
mkdir -p "$R/etc/ssh/sshd_config.d"
cat >"$R/etc/ssh/sshd_config.d/00-llmfleet-lab.conf" <<'EOF'
# llmfleet lab node: key-only login (ops, and root for the test harness), no PAM/logind session
# setup, room for many forks.
HostKey /etc/ssh/ssh_host_ed25519_key
PermitRootLogin prohibit-password
PasswordAuthentication no
UsePAM no
UseDNS no
MaxStartups 200:30:400
MaxSessions 200
EOF

# Lab only: the node's system Python (the one Ansible runs modules with) keeps the bytecode of what it
# imports from AnsiballZ zips (zipcache.py says why). Not the engine's venv, not the host.
site_dir=$(/usr/bin/python3 -c 'import site; print(site.getsitepackages()[0])')
install -d -m 0755 "$R$site_dir"
install -m 0644 "$(dirname "$(readlink -f "$0")")/zipcache.py" "$R$site_dir/_llmfleet_lab_zipcache.py"
echo "import _llmfleet_lab_zipcache" >"$R$site_dir/llmfleet-lab-zipcache.pth"

# Units that must not run once per node (host services, timers, consoles, clock).
for u in postgresql.service getty@tty1.service console-getty.service serial-getty@console.service \
  systemd-timesyncd.service systemd-pstore.service e2scrub_reap.service networking.service \
  systemd-networkd-wait-online.service apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer \
  e2scrub_all.timer fstrim.timer man-db.timer; do
  ln -sf /dev/null "$R/etc/systemd/system/$u"
done
mkdir -p "$R/etc/systemd/system/multi-user.target.wants" "$R/etc/systemd/journald.conf.d"
ln -sf /lib/systemd/system/ssh.service "$R/etc/systemd/system/multi-user.target.wants/ssh.service"
printf '[Journal]\nStorage=volatile\n' >"$R/etc/systemd/journald.conf.d/llmfleet-lab.conf"

cd "$R"
mkdir -p oldroot
pivot_root . oldroot
cd /
umount -l /oldroot
rmdir /oldroot

# A node must not load kernel modules, set the (shared) clock or poke raw I/O.
exec setpriv --bounding-set -sys_module,-sys_time,-sys_rawio \
  env -i container=labnode PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  /lib/systemd/systemd --system --unit=multi-user.target
