#!/usr/bin/env bash
# Two "hosts" on one machine: two network namespaces joined by a veth pair.
#
#   scripts/two_hosts.sh setup NAME      create NAME-h0 and NAME-h1; prints KEY=VALUE lines
#   scripts/two_hosts.sh exec NAME H CMD run CMD inside host H (0 or 1), GLOO_SOCKET_IFNAME set and,
#                                        in a UTS namespace of its own, the hostname NAME-hH
#   scripts/two_hosts.sh teardown NAME   delete both namespaces (and with them the veth pair)
#   scripts/two_hosts.sh check           exit 0 when this shell may create namespaces, else say why
#
# Each namespace holds only its loopback and its end of the veth, addressed in 198.18.0.0/15
# (RFC 2544, reserved for benchmark tests), so the traffic between the two hosts never leaves the
# namespaces and no address of the real machine is touched. Needs root (CAP_NET_ADMIN) and iproute2.
#
# NAME keeps the interface names inside Linux's 15-character limit: at most 10 characters.
set -euo pipefail

ADDR0=${ZS_TWO_HOSTS_ADDR0:-198.18.0.1}
ADDR1=${ZS_TWO_HOSTS_ADDR1:-198.18.0.2}
PREFIX=${ZS_TWO_HOSTS_PREFIX:-30}

die() { echo "two_hosts.sh: $*" >&2; exit 1; }

check_name() {
    [[ "${1:-}" =~ ^[a-zA-Z0-9_]{1,10}$ ]] || die "NAME must be 1-10 letters, digits or _ (got '${1:-}')"
}

ns() { echo "$1-h$2"; }
ifname() { echo "$1v$2"; }

cmd_check() {
    command -v ip >/dev/null || die "iproute2 ('ip') is not installed; apt-get install iproute2"
    [[ $(id -u) -eq 0 ]] || die "network namespaces need root (CAP_NET_ADMIN); run as root"
    local probe="zsprobe$$"
    ip netns add "$probe" 2>/dev/null || die "'ip netns add' failed: this sandbox does not allow network namespaces"
    ip netns del "$probe"
}

cmd_setup() {
    local name=$1
    check_name "$name"
    cmd_teardown "$name" 2>/dev/null || true  # a crashed earlier run may have left them
    ip netns add "$(ns "$name" 0)"
    ip netns add "$(ns "$name" 1)"
    ip link add "$(ifname "$name" 0)" type veth peer name "$(ifname "$name" 1)"
    local h addr
    for h in 0 1; do
        addr=$([[ $h -eq 0 ]] && echo "$ADDR0" || echo "$ADDR1")
        ip link set "$(ifname "$name" "$h")" netns "$(ns "$name" "$h")"
        ip -n "$(ns "$name" "$h")" addr add "$addr/$PREFIX" dev "$(ifname "$name" "$h")"
        ip -n "$(ns "$name" "$h")" link set "$(ifname "$name" "$h")" up
        ip -n "$(ns "$name" "$h")" link set lo up
    done
    echo "NS0=$(ns "$name" 0)"
    echo "NS1=$(ns "$name" 1)"
    echo "IF0=$(ifname "$name" 0)"
    echo "IF1=$(ifname "$name" 1)"
    echo "ADDR0=$ADDR0"
    echo "ADDR1=$ADDR1"
}

cmd_exec() {
    local name=$1 host=$2
    shift 2
    check_name "$name"
    [[ "$host" == 0 || "$host" == 1 ]] || die "host must be 0 or 1 (got '$host')"
    # gloo binds to the address of this interface, which the other host can reach. Each host gets
    # its own hostname (a UTS namespace), as two machines have; where unshare cannot make one,
    # ZEROSHARD_HOST names the host instead (zeroshard/comm/host_probe.py).
    local hn ifn
    hn=$(ns "$name" "$host")
    ifn=$(ifname "$name" "$host")
    if unshare --uts true 2>/dev/null; then
        exec ip netns exec "$hn" unshare --uts env GLOO_SOCKET_IFNAME="$ifn" ZS_TWO_HOSTS_HOSTNAME="$hn" \
            bash -c 'hostname "$ZS_TWO_HOSTS_HOSTNAME" && unset ZS_TWO_HOSTS_HOSTNAME && exec "$@"' two_hosts "$@"
    fi
    exec ip netns exec "$hn" env GLOO_SOCKET_IFNAME="$ifn" ZEROSHARD_HOST="$hn" "$@"
}

cmd_teardown() {
    local name=$1 h
    check_name "$name"
    for h in 0 1; do
        # Deleting a namespace deletes the veth end inside it, and with it the peer.
        if ip netns list | awk '{print $1}' | grep -qx "$(ns "$name" "$h")"; then
            ip netns pids "$(ns "$name" "$h")" | xargs -r kill -9 2>/dev/null || true
            ip netns del "$(ns "$name" "$h")"
        fi
    done
    ip link del "$(ifname "$name" 0)" 2>/dev/null || true  # only if setup died before moving it
}

case "${1:-}" in
    check) cmd_check ;;
    setup) [[ $# -eq 2 ]] || die "usage: $0 setup NAME"; cmd_setup "$2" ;;
    exec) [[ $# -ge 4 ]] || die "usage: $0 exec NAME HOST CMD..."; shift; cmd_exec "$@" ;;
    teardown) [[ $# -eq 2 ]] || die "usage: $0 teardown NAME"; cmd_teardown "$2" ;;
    *) die "usage: $0 {check|setup NAME|exec NAME HOST CMD...|teardown NAME}" ;;
esac
