#!/usr/bin/env bash
# The node-loss drill with Ray across two hosts of the network bed (splitserve/testbed):
# a Ray head in host a (custom resource `prefill`; serve and the load run here too) and a Ray
# node in host b (resource `decode`), so prefill and decode engines run on different hosts and
# the KV crosses b's shaped link. Engines reach the frontend at a's bed address: CurveZMQ and the
# KV HMAC secret are on (serve generates both). Run it through the bed, which also removes every
# process it leaves in the hosts (the Ray daemons included):
#
#   python -m splitserve.testbed run --hosts a,b --rate 1gbit -- bench/ray_node_loss_netbed.sh \
#       [ray_node_loss.py flags] [-- serve flags]
set -euo pipefail
PY=${PYTHON:-python}
export RAY_AUTH_MODE=token  # the head turns token auth on; the node and the driver must use it too
RAY="$(dirname "$(command -v "$PY")")/ray"
in_a() { ip netns exec "$NETBED_A_NS" "$@"; }
in_b() { ip netns exec "$NETBED_B_NS" "$@"; }
# The bed ends the Ray daemons by killing what runs in its hosts, so `ray stop` never removes the
# head's address from Ray's file, and a later local `ray.init()` would try to join the dead head.
current=/tmp/ray/ray_current_cluster
trap '[ "$(cat "$current" 2>/dev/null)" = "$NETBED_A_ADDR:6379" ] && rm -f "$current"' EXIT
common=(--num-cpus 1 --object-store-memory 100000000 --disable-usage-stats)
in_a "$RAY" start --head --node-ip-address "$NETBED_A_ADDR" --port 6379 --include-dashboard false \
    --resources '{"prefill": 1}' "${common[@]}" >/dev/null
in_b "$RAY" start --address "$NETBED_A_ADDR:6379" --node-ip-address "$NETBED_B_ADDR" \
    --resources '{"decode": 1}' "${common[@]}" >/dev/null
drill=() serve=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do drill+=("$1"); shift; done
[ $# -gt 0 ] && shift && serve=("$@")
in_a "$PY" bench/ray_node_loss.py --ray "$NETBED_A_ADDR:6379" "${drill[@]}" -- \
    --engine-address "tcp://$NETBED_A_ADDR:0" --ray-resource prefill=prefill --ray-resource decode=decode \
    "${serve[@]}"
