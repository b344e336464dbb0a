#!/usr/bin/env bash
# Network namespaces as test hosts: NODES namespaces, each with two links:
#   front: veth to bridge ${NAME}f (root side 10.231.0.254/24); node i is 10.231.0.i
#          (HTTP: router, health probes, the test client in the root namespace)
#   data:  veth to bridge ${NAME}d (no address in the root namespace); node i is 10.232.0.i
#          (control sockets, bootstrap, Mooncake: what a link cut takes away)
#
#   scripts/netns.sh up   NAME NODES     create (after removing leftovers of the same NAME)
#   scripts/netns.sh down NAME           remove everything NAME created
#   scripts/netns.sh exec NAME I CMD...  run CMD in node I
#   scripts/netns.sh link NAME I up|down set node I's data link up or down
#
# Needs root and iproute2. Only the addresses above, created here, are used.
set -euo pipefail
cmd=${1:?usage: netns.sh up|down|exec|link NAME ...}
name=${2:?NAME}
[ ${#name} -le 8 ] || { echo "NAME must be at most 8 characters" >&2; exit 2; }
ns() { echo "${name}n$1"; }

down() {
    for n in $(ip netns list | awk '{print $1}' | grep "^${name}n[0-9]*$" || true); do ip netns del "$n"; done
    for l in "${name}f" "${name}d"; do ip link del "$l" 2>/dev/null || true; done
    for l in $(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | grep "^${name}[fd][0-9]*r$" || true); do
        ip link del "$l" 2>/dev/null || true
    done
}

case "$cmd" in
up)
    nodes=${3:?NODES}
    down
    ip link add "${name}f" type bridge
    ip link add "${name}d" type bridge
    ip addr add 10.231.0.254/24 dev "${name}f"
    ip link set "${name}f" up
    ip link set "${name}d" up
    for i in $(seq 1 "$nodes"); do
        n=$(ns "$i")
        ip netns add "$n"
        ip -n "$n" link set lo up
        for kind in f d; do
            ip link add "${name}${kind}${i}r" type veth peer name "${name}${kind}${i}"
            ip link set "${name}${kind}${i}" netns "$n"
            ip link set "${name}${kind}${i}r" master "${name}${kind}"
            ip link set "${name}${kind}${i}r" up
            ip -n "$n" link set "${name}${kind}${i}" up
        done
        ip -n "$n" addr add "10.231.0.$i/24" dev "${name}f${i}"
        ip -n "$n" addr add "10.232.0.$i/24" dev "${name}d${i}"
    done
    ;;
down)
    down
    ;;
exec)
    i=${3:?I}; shift 3
    exec ip netns exec "$(ns "$i")" "$@"
    ;;
link)
    i=${3:?I}; state=${4:?up|down}
    ip -n "$(ns "$i")" link set "${name}d${i}" "$state"
    ;;
*)
    echo "unknown command $cmd" >&2; exit 2
    ;;
esac
