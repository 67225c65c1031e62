#!/bin/busybox sh
# /init of sandfleet's guest initramfs: turns the disks the host attached into
# the sandbox's root and hands PID 1 over to the agent.
#
# The boot contract (kernel command line, disk serials, the agent's port) is
# the one in sandfleet.backends.vm.guest's docstring. The root is built like
# the container backend's OCI config (backends/container/bundle.py); the masked
# and read-only path lists come from there, written into the initramfs by
# guest.py, so the two backends cannot drift apart.
#
# Boot time under TCG is what this script is judged by: no udev, no sleeps
# except short bounded polls for devices, only the modules a sandbox needs.

export PATH=/bin

# Any failure: say what failed on the console and power off. QEMU runs with
# -no-reboot, so it exits and the host shows the console's tail.
fail() {
	echo "sandfleet-init: $*"
	poweroff -f
	exit 1 # poweroff failed: the kernel panics, and panic=-1 below reboots (= exits QEMU)
}

r=/newroot

# Stage 2, PID 1 of a PID namespace of its own (see the end of stage 1): what a
# command sees of processes is the sandbox's, as in a container, not the
# guest kernel's threads. Its /proc is mounted here, in that namespace.
if [ "$1" = stage2 ]; then
	mount -t proc -o nosuid,nodev,noexec proc $r/proc || fail "mount $r/proc"
	while read -r p; do
		if [ -d "$r$p" ]; then
			mount -t tmpfs -o ro,nosuid,nodev,noexec tmpfs "$r$p" || fail "mask $p"
		elif [ -e "$r$p" ]; then
			mount -o bind $r/dev/null "$r$p" || fail "mask $p"
		fi
	done </sandfleet/masked-paths
	while read -r p; do
		[ -e "$r$p" ] || continue
		mount -o bind "$r$p" "$r$p" && mount -o remount,bind,ro "$r$p" || fail "read-only $p"
	done </sandfleet/readonly-paths
	if [ "$2" = 1 ]; then
		read -r up _ </proc/uptime
		echo "sandfleet-init: uptime $up s"
		mount
		ls -la $r
	fi
	echo "sandfleet-init: starting agent"
	exec env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
		TERM=xterm switch_root $r /.sandfleet/agent --vport-fd 3 --run-dir /.sandfleet/run \
		--oom-events /sys/fs/cgroup/sandbox/memory.events
fi

mount -t proc -o nosuid,nodev,noexec proc /proc || fail "mount /proc"

# A panic (e.g. the agent, PID 1, dying) must end the VM, not leave it spinning.
echo -1 >/proc/sys/kernel/panic

# Dotted parameters are not passed to init: read them from the command line.
layers='' memory_mb='' pids='' probe='' debug=''
read -r cmdline </proc/cmdline
for arg in $cmdline; do
	case "$arg" in
	sandfleet.layers=*) layers=${arg#*=} ;;
	sandfleet.memory_mb=*) memory_mb=${arg#*=} ;;
	sandfleet.pids=*) pids=${arg#*=} ;;
	sandfleet.probe=*) probe=${arg#*=} ;;
	sandfleet.debug=*) debug=${arg#*=} ;;
	esac
done

# Probe mode (is KVM usable?): answer before doing anything slow.
if [ "$probe" = 1 ]; then
	echo sandfleet-probe-ok
	poweroff -f
	exit 1
fi

for v in layers memory_mb pids; do
	eval "val=\$$v"
	case "$val" in
	'' | *[!0-9]*) fail "sandfleet.$v=<integer> missing from the kernel command line" ;;
	esac
done
[ "$layers" -ge 1 ] || fail "sandfleet.layers must be at least 1"

mount -t sysfs -o nosuid,nodev,noexec sysfs /sys || fail "mount /sys"
mount -t devtmpfs -o nosuid,noexec devtmpfs /dev || fail "mount /dev"

# Modules, dependencies first (guest.py computed the order). A transport
# whose bus is empty is skipped: microvm has no PCI, q35 no virtio-mmio.
read -r kver </proc/sys/kernel/osrelease
has_pci=''
has_mmio=''
for d in /sys/bus/pci/devices/*; do [ -e "$d" ] && has_pci=1 && break; done
for d in /sys/bus/platform/devices/LNRO0005:*; do [ -e "$d" ] && has_mmio=1 && break; done
while read -r mod; do
	case "$mod" in
	virtio_pci*) [ -n "$has_pci" ] || continue ;;
	virtio_mmio) [ -n "$has_mmio" ] || continue ;;
	esac
	insmod "/lib/modules/$kver/$mod.ko" || fail "insmod $mod"
done <"/lib/modules/$kver/load-order"

# Poll for a bounded time: devices are probed as the drivers load, but a
# port's name arrives from the host asynchronously. Builtins only (read, not
# cat): under TCG every fork costs milliseconds.
uptime_s() {
	read -r up _ </proc/uptime
	up=${up%.*}
}
wait_for() { # <what> <shell test>
	uptime_s
	deadline=$((up + 10))
	until eval "$2"; do
		uptime_s
		[ "$up" -lt $deadline ] || fail "$1 did not appear within 10 s"
		sleep 0.01
	done
}

# Disks by serial, never by order: disk_<serial>=/dev/vdX.
scan_disks() {
	for d in /sys/block/vd*; do
		[ -e "$d/serial" ] || continue
		serial=''
		read -r serial <"$d/serial" # no newline at its end: read "fails" but sets it
		case "$serial" in
		*[!a-z0-9]*) ;; # not ours, and unsafe in a variable name
		sfl[0-9]*[md] | sfdisk) eval "disk_$serial=/dev/${d##*/}" ;;
		esac
	done
}
all_disks() {
	scan_disks
	[ -n "$disk_sfdisk" ] || return 1
	i=0
	while [ $i -lt "$layers" ]; do
		eval "[ -n \"\$disk_sfl${i}m\" ]" || return 1
		i=$((i + 1))
	done
}
wait_for "the layer and writable disks (serials sfl<i>m, sfdisk)" all_disks

agent_port() {
	for p in /sys/class/virtio-ports/*; do
		name=''
		[ ! -e "$p/name" ] || read -r name <"$p/name"
		if [ "$name" = sandfleet.agent ]; then
			port=/dev/${p##*/}
			return 0
		fi
	done
	return 1
}
wait_for "the virtio-serial port sandfleet.agent" agent_port

# Layers, bottom first in i; overlay wants them top first.
lower=''
i=0
while [ $i -lt "$layers" ]; do
	eval "meta=\$disk_sfl${i}m data=\$disk_sfl${i}d"
	dir=/sandfleet/layers/$i
	mkdir -p $dir
	if [ -n "$data" ]; then
		mount -t erofs -o ro,device="$data" "$meta" $dir || fail "mount layer $i ($meta + $data)"
	else
		mount -t erofs -o ro "$meta" $dir || fail "mount layer $i ($meta)"
	fi
	lower=$dir${lower:+:$lower}
	i=$((i + 1))
done

# The writable layer: the host formatted it; after a restore upper/ and
# work/ exist already. discard: deleted files give the host its space back.
mkdir -p /sandfleet/disk
mount -t ext4 -o discard "$disk_sfdisk" /sandfleet/disk || fail "mount the writable disk $disk_sfdisk"
mkdir -p /sandfleet/disk/upper /sandfleet/disk/work || fail "mkdir upper/work on the writable disk"
# nodev: device nodes in an image are useless inside, as under runc's device
# cgroup; the sandbox's /dev is a tmpfs of its own below.
mount -t overlay -o nodev,lowerdir="$lower",upperdir=/sandfleet/disk/upper,workdir=/sandfleet/disk/work \
	overlay /newroot || fail "mount the overlay root"

# Limits for everything the agent runs: PID 1 moves into the cgroup, its
# children inherit it. Kernel threads stay outside.
mkdir -p /sys/fs/cgroup
mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 /sys/fs/cgroup || fail "mount cgroup2"
echo "+memory +pids" >/sys/fs/cgroup/cgroup.subtree_control || fail "enable memory, pids controllers"
cg=/sys/fs/cgroup/sandbox
mkdir -p $cg || fail "mkdir cgroup sandbox"
echo $((memory_mb * 1024 * 1024)) >$cg/memory.max || fail "memory.max=${memory_mb}M"
echo "$pids" >$cg/pids.max || fail "pids.max=$pids"
[ ! -e $cg/memory.swap.max ] || echo 0 >$cg/memory.swap.max || fail "memory.swap.max"
echo $$ >$cg/cgroup.procs || fail "move PID 1 into the cgroup"

# Kernel-wide settings while /proc/sys is still writable.
echo 0 >/proc/sys/user/max_user_namespaces || fail "user.max_user_namespaces=0"
# As on a host (whose RAM dwarfs a sandbox's limit): an allocation larger than
# the guest's RAM succeeds, and touching it meets the cgroup's OOM killer, not ENOMEM.
echo 1 >/proc/sys/vm/overcommit_memory || fail "vm.overcommit_memory=1"
ip link set lo up || fail "ip link set lo up"

# The sandbox's view, as runc builds it (bundle.oci_config's mounts).
mkdir -p $r/proc $r/sys $r/dev $r/.sandfleet || fail "mkdir the root's mount points"
mount -t sysfs -o ro,nosuid,nodev,noexec sysfs $r/sys || fail "mount $r/sys"
mount -t tmpfs -o nosuid,strictatime,mode=755,size=65536k tmpfs $r/dev || fail "mount $r/dev"
mknod -m 666 $r/dev/null c 1 3 &&
	mknod -m 666 $r/dev/zero c 1 5 &&
	mknod -m 666 $r/dev/full c 1 7 &&
	mknod -m 666 $r/dev/random c 1 8 &&
	mknod -m 666 $r/dev/urandom c 1 9 &&
	mknod -m 666 $r/dev/tty c 5 0 &&
	ln -s pts/ptmx $r/dev/ptmx &&
	ln -s /proc/self/fd $r/dev/fd &&
	ln -s /proc/self/fd/0 $r/dev/stdin &&
	ln -s /proc/self/fd/1 $r/dev/stdout &&
	ln -s /proc/self/fd/2 $r/dev/stderr &&
	mkdir $r/dev/pts $r/dev/shm $r/dev/mqueue || fail "populate $r/dev"
mount -t devpts -o nosuid,noexec,newinstance,ptmxmode=0666,mode=0620 devpts $r/dev/pts ||
	fail "mount $r/dev/pts"
mount -t tmpfs -o nosuid,noexec,nodev,mode=1777,size=65536k shm $r/dev/shm || fail "mount $r/dev/shm"
mount -t mqueue -o nosuid,noexec,nodev mqueue $r/dev/mqueue || fail "mount $r/dev/mqueue"
mount -o bind /sys/fs/cgroup $r/sys/fs/cgroup &&
	mount -o remount,bind,ro,nosuid,nodev,noexec $r/sys/fs/cgroup || fail "mount $r/sys/fs/cgroup"

# The agent's own directory: out of the image, out of reach of other users.
mount -t tmpfs -o nosuid,nodev,mode=700,size=4m tmpfs $r/.sandfleet || fail "mount $r/.sandfleet"
cp /sandfleet-agent $r/.sandfleet/agent && mkdir -m 700 $r/.sandfleet/run || fail "install the agent"

# A failed redirection of exec ends the shell: check first, to say why.
[ -c "$port" ] || fail "$port is not a character device"
exec 3<>"$port"

if [ "$debug" = 1 ]; then
	echo "sandfleet-init: cgroup sandbox: memory.max $(cat $cg/memory.max) pids.max $(cat $cg/pids.max)"
fi
# This process stays PID 1 of the guest, waiting; if the sandbox's PID 1 (the
# agent) ever ends, so does it, and the kernel's panic ends the VM.
exec unshare --pid --mount --fork /init stage2 "$debug"
