#!/bin/bash
# Network namespaces for the netem tests and benchmark: the server in its
# own namespace (a bridge at 10.77.0.1), each client in another, joined by
# veth pairs; nothing else is reachable (each namespace has only its
# loopback and its veth). tc netem shapes each link in both directions.
#
#   netns.sh check-ns                exit 0 if namespaces can be made here
#   netns.sh check-netem             exit 0 if the kernel has sch_netem
#   netns.sh up TAG N                server + N clients (client i at 10.77.0.(10+i))
#   netns.sh shape TAG N "QDISC"     e.g. "netem delay 20ms 5ms loss 0.5% rate 1gbit"
#   netns.sh partition TAG I         client I's link is cut (no packet passes)
#   netns.sh heal TAG I              client I's link is back
#   netns.sh down TAG N              removes all of it (processes in it too)
#   netns.sh exec TAG server|I CMD…  runs CMD in that namespace
set -euo pipefail

srv() { echo "mf${1}s"; }
cli() { echo "mf${1}c${2}"; }

case "${1:-}" in
  check-ns | check-netem)
    name="mfchk$$"
    ip netns add "$name" 2>/dev/null || exit 1
    ok=0
    ip netns exec "$name" ip link set lo up 2>/dev/null || ok=1
    if [ "$1" = check-netem ]; then
      ip netns exec "$name" tc qdisc add dev lo root netem delay 1ms 2>/dev/null || ok=1
    fi
    ip netns del "$name"
    exit $ok
    ;;
  up)
    tag=$2 n=$3 s=$(srv "$2")
    ip netns add "$s"
    ip -n "$s" link set lo up
    ip -n "$s" link add "mf${tag}br" type bridge
    ip -n "$s" addr add 10.77.0.1/24 dev "mf${tag}br"
    ip -n "$s" link set "mf${tag}br" up
    for ((i = 0; i < n; i++)); do
      c=$(cli "$tag" "$i")
      ip netns add "$c"
      ip -n "$c" link set lo up
      ip link add "${c}a" netns "$c" type veth peer name "${c}b" netns "$s"
      ip -n "$c" addr add "10.77.0.$((10 + i))/24" dev "${c}a"
      ip -n "$c" link set "${c}a" up
      ip -n "$s" link set "${c}b" master "mf${tag}br"
      ip -n "$s" link set "${c}b" up
    done
    ;;
  shape)
    tag=$2 n=$3 s=$(srv "$2")
    for ((i = 0; i < n; i++)); do
      c=$(cli "$tag" "$i")
      # shellcheck disable=SC2086
      ip netns exec "$c" tc qdisc replace dev "${c}a" root $4
      # shellcheck disable=SC2086
      ip netns exec "$s" tc qdisc replace dev "${c}b" root $4
    done
    ;;
  partition)
    # The bridge's end goes down: packets either way are lost, as on a cut
    # cable; the client's end stays up, so its TCP only retransmits.
    ip -n "$(srv "$2")" link set "$(cli "$2" "$3")b" down
    ;;
  heal)
    ip -n "$(srv "$2")" link set "$(cli "$2" "$3")b" up
    ;;
  down)
    # Processes still in the namespaces go first: one whose link was cut
    # (an MPI daemon, say) may never hear that its job ended.
    tag=$2 n=$3
    for ns in "$(srv "$tag")" $(for ((i = 0; i < n; i++)); do cli "$tag" "$i"; done); do
      ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
      ip netns del "$ns" 2>/dev/null || true
    done
    ;;
  exec)
    tag=$2 who=$3
    shift 3
    if [ "$who" = server ]; then ns=$(srv "$tag"); else ns=$(cli "$tag" "$who"); fi
    exec ip netns exec "$ns" "$@"
    ;;
  *)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac
