#!/bin/busybox sh
# rdmalab guest init (PID 1 of the initramfs). See rdmalab/__init__.py for the whole lifecycle.
# Protocol with the host, on the console (ttyS0 = qemu's stdout): lines starting "@@rdmalab "
# are control lines (phase, ready, exit=N); everything else is the command's output.
# The command is /outbox/command.sh, written by the host for each run; its exit status also
# goes to /outbox/rc.
/bin/busybox mkdir -p /bin /sbin /proc /sys /dev /newroot /outbox
/bin/busybox --install -s /bin
export PATH=/bin

say() { echo "@@rdmalab $*"; }
die() { say "error $*"; say "exit=125"; poweroff -f; sleep 60; }

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
stty -F /dev/ttyS0 raw -echo 2>/dev/null
say "phase modules"
while read -r mod; do
    insmod "/lib/modules/$mod.ko" || die "insmod $mod failed"
done < /etc/rdmalab/modules

say "phase mounts"
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 hostroot /newroot \
    || die "cannot mount the host root over virtio-9p"
mount -t 9p -o trans=virtio,version=9p2000.L,rw,msize=512000 outbox /outbox \
    || die "cannot mount the outbox"
mount -t proc proc /newroot/proc
mount -t sysfs sysfs /newroot/sys
mount -t devtmpfs devtmpfs /newroot/dev
mkdir -p /newroot/dev/shm /newroot/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /newroot/dev/shm
mount -t devpts devpts /newroot/dev/pts
for d in /tmp /run /var/tmp; do
    [ -d "/newroot$d" ] && mount -t tmpfs -o mode=1777 tmpfs "/newroot$d"
done
mkdir -p /newroot/tmp/rdmalab /newroot/tmp/home
# The working directory, shared on its own (a checkout under /tmp is hidden by the tmpfs above).
wd=$(cat /outbox/workdir)
mkdir -p "/newroot$wd" 2>/dev/null
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 workdir "/newroot$wd" \
    || die "cannot mount the working directory $wd"
mount --bind /outbox /newroot/tmp/rdmalab

say "phase network"
# Two rxe devices over a veth pair, each end with its own address (/etc/rdmalab/network).
. /etc/rdmalab/network
ip() { chroot /newroot /usr/sbin/ip "$@"; }
ip link set lo up
ip link add "$VETH0" type veth peer name "$VETH1" || die "veth pair"
ip addr add "$ADDR0/24" dev "$VETH0"
ip addr add "$ADDR1/24" dev "$VETH1"
ip link set "$VETH0" up
ip link set "$VETH1" up
# Both addresses are local, so the kernel would deliver veth0 -> veth1 traffic through lo, where
# rxe does not listen: locally sent packets between the two addresses leave through the
# sender's own veth end (policy routing, "iif lo" = locally generated), and the receiving end
# accepts a local source address.
for dev in all "$VETH0" "$VETH1"; do
    echo 1 > /proc/sys/net/ipv4/conf/$dev/accept_local
    echo 0 > /proc/sys/net/ipv4/conf/$dev/rp_filter
done
ip rule add pref 10 iif lo from "$ADDR0" to "$ADDR1" lookup 100
ip rule add pref 10 iif lo from "$ADDR1" to "$ADDR0" lookup 101
ip rule add pref 100 lookup local
ip rule del pref 0 lookup local
ip route add "$ADDR1" dev "$VETH0" src "$ADDR0" table 100
ip route add "$ADDR0" dev "$VETH1" src "$ADDR1" table 101
# Static neighbours: ARP between two local addresses is not something to depend on.
ip neigh replace "$ADDR1" lladdr "$(cat /sys/class/net/$VETH1/address)" dev "$VETH0" nud permanent
ip neigh replace "$ADDR0" lladdr "$(cat /sys/class/net/$VETH0/address)" dev "$VETH1" nud permanent
chroot /newroot rdma link add "$RXE0" type rxe netdev "$VETH0" || die "rdma link add $RXE0"
chroot /newroot rdma link add "$RXE1" type rxe netdev "$VETH1" || die "rdma link add $RXE1"
say "ready uptime=$(cut -d' ' -f1 /proc/uptime)"

chroot /newroot /bin/sh /tmp/rdmalab/command.sh < /dev/null > /dev/ttyS0 2>&1
rc=$?
echo "$rc" > /outbox/rc
sync
say "exit=$rc"
poweroff -f
sleep 60
