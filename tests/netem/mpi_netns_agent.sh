#!/bin/bash
# OpenMPI's launch agent for ranks in the network namespaces of netns.sh, in
# place of ssh: each namespace is a host. mpirun runs in the server's
# namespace and calls this as it would call ssh,
#
#   mpi_netns_agent.sh [ssh options] HOST COMMAND...
#
# with HOST an address from its hostfile: 10.77.0.1 is the server's
# namespace, 10.77.0.(10+i) client i's. COMMAND (OpenMPI's orted daemon, as
# one shell line) runs in that namespace under a host name of its own, so
# that OpenMPI sees separate nodes (MPI_COMM_TYPE_SHARED gives one rank a
# node, hence no shared-memory ring) and no rank can reach another through
# anything but the namespace's veth link. The namespaces' TAG comes from
# MEMFL_NETNS_TAG, which mpirun passes on to its agent.
#
#   MEMFL_NETNS_TAG=TAG netns.sh exec TAG server mpirun \
#     --mca plm_rsh_agent tests/netem/mpi_netns_agent.sh \
#     --mca plm_rsh_no_tree_spawn 1 --hostfile HOSTS ...
#
# plm_rsh_no_tree_spawn: mpirun starts every daemon itself; in a tree a
# daemon would start others from a namespace without MEMFL_NETNS_TAG.
set -euo pipefail

die() {
  echo "mpi_netns_agent.sh: $*" >&2
  exit 255 # what ssh returns when it cannot reach the host
}

# ssh's options, as OpenMPI may pass them; those of ssh that take a value
# take it here too.
while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in
    -[bcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;
    *) shift ;;
  esac
done
[[ $# -ge 2 ]] || die "usage: mpi_netns_agent.sh [ssh options] HOST COMMAND..."
host=$1
shift
tag=${MEMFL_NETNS_TAG:-}
[[ -n $tag ]] || die "MEMFL_NETNS_TAG is not set (the TAG given to netns.sh up)"

case $host in
  10.77.0.1) ns="mf${tag}s" ;;
  10.77.0.*)
    last=${host##*.}
    [[ $last =~ ^[0-9]+$ && $last -ge 10 ]] || die "$host is no client namespace's address"
    ns="mf${tag}c$((last - 10))"
    ;;
  *) die "$host is no namespace's address (10.77.0.1 the server, 10.77.0.(10+i) client i)" ;;
esac
[[ -e /run/netns/$ns ]] || die "no network namespace $ns for $host (netns.sh up $tag N first)"

# ssh joins its arguments into one line for the remote shell: so does this.
# The host name is set in a UTS namespace of the daemon's own, which its
# ranks inherit.
# shellcheck disable=SC2016 # $1 and $2 are the inner shell's
exec ip netns exec "$ns" unshare --uts /bin/sh -c 'hostname "$1" && exec /bin/sh -c "$2"' sh "$ns" "$*"
