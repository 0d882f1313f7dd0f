#!/bin/bash
# A throw-away Redis Cluster on loopback for the tests and benchmarks of the
# remote tier: 3 masters + 3 replicas (redis-server --cluster-enabled yes,
# `redis-cli --cluster create --cluster-replicas 1`), in a temporary directory.
#
#   scripts/redis-cluster.sh start DIR [OWNER_PID]   prints the 6 ports, writes DIR/ports
#   scripts/redis-cluster.sh stop DIR                kills exactly the servers it started
#   scripts/redis-cluster.sh kill DIR PORT           SIGKILL one server (failover tests)
#   scripts/redis-cluster.sh wait DIR                waits for cluster_state:ok (bounded)
#
# Every server binds 127.0.0.1 only. Ports: a random base in 20000..44999 (the
# cluster bus is port + 10000); if a port is taken the whole set is retried on
# another base (KVR_CLUSTER_BASE=N: exactly N..N+5, one try). Every wait is bounded; `start` cleans up after itself on
# failure. With OWNER_PID, a watcher stops the cluster when that process is
# gone, so a crashed test never leaves servers running.
#
# ACL: user "kvr" with password "kvrpass" (all keys, all commands) besides the
# default user, so the tests can use an ACL user and check a wrong password.
set -u
cmd=${1:?usage: $0 start|stop|kill|wait DIR}
dir=${2:?usage: $0 start|stop|kill|wait DIR}
NODE_TIMEOUT_MS=${KVR_CLUSTER_NODE_TIMEOUT:-1000}

stop_all() {
  [ -d "$dir" ] || return 0
  for pf in "$dir"/*/redis.pid; do
    [ -f "$pf" ] || continue
    pid=$(cat "$pf" 2>/dev/null)
    [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null
  done
  if [ -f "$dir/watcher.pid" ]; then
    wp=$(cat "$dir/watcher.pid")
    [ "$wp" != "$$" ] && kill "$wp" 2>/dev/null
  fi
  return 0
}

# cluster_state:ok on every live node, and every live replica in sync (a
# replica that never synced cannot take over when its master dies).
wait_ok() {
  local deadline=$((SECONDS + ${1:-40}))
  while [ $SECONDS -lt $deadline ]; do
    local all=1
    for p in $(cat "$dir/ports"); do
      [ -f "$dir/$p/dead" ] && continue
      st=$(timeout 2 redis-cli -h 127.0.0.1 -p "$p" cluster info 2>/dev/null | tr -d '\r' |
           sed -n 's/^cluster_state://p')
      [ "$st" = ok ] || { all=0; break; }
      rep=$(timeout 2 redis-cli -h 127.0.0.1 -p "$p" info replication 2>/dev/null | tr -d '\r')
      case "$rep" in
        *role:slave*) case "$rep" in *master_link_status:up*) ;; *) all=0; break ;; esac ;;
      esac
    done
    [ $all = 1 ] && return 0
    sleep 0.2
  done
  echo "redis-cluster: cluster_state not ok after ${1:-40} s" >&2
  return 1
}

start_one() { # port
  local p=$1 d="$dir/$1"
  mkdir -p "$d"
  redis-server --port "$p" --bind 127.0.0.1 --protected-mode no --daemonize yes \
    --dir "$d" --pidfile "$d/redis.pid" --logfile "$d/redis.log" \
    --cluster-enabled yes --cluster-config-file "$d/nodes.conf" \
    --cluster-node-timeout "$NODE_TIMEOUT_MS" --save '' --appendonly no \
    --repl-diskless-sync-delay 0 --cluster-replica-validity-factor 0 \
    --user kvr on '>kvrpass' '~*' '&*' '+@all' \
    --maxmemory 1gb --maxmemory-policy allkeys-lru >/dev/null 2>&1 || return 1
  for _ in $(seq 1 100); do
    redis-cli -h 127.0.0.1 -p "$p" ping 2>/dev/null | grep -q PONG && return 0
    sleep 0.05
  done
  return 1
}

case "$cmd" in
start)
  owner=${3:-}
  mkdir -p "$dir"
  for attempt in 1 2 3 4 5; do
    base=$((20000 + (RANDOM * 32768 + RANDOM) % 25000))
    [ -n "${KVR_CLUSTER_BASE:-}" ] && base=$KVR_CLUSTER_BASE   # one fixed try
    ports=""; okp=1
    for i in 0 1 2 3 4 5; do
      p=$((base + i))
      if ! start_one "$p"; then okp=0; break; fi
      ports="$ports $p"
    done
    echo $ports >"$dir/ports"
    if [ $okp = 1 ]; then
      addrs=""; for p in $ports; do addrs="$addrs 127.0.0.1:$p"; done
      # shellcheck disable=SC2086
      if timeout 60 redis-cli --cluster create $addrs --cluster-replicas 1 --cluster-yes \
           >"$dir/create.log" 2>&1 && wait_ok 40; then
        if [ -n "$owner" ]; then
          ( trap '' HUP
            while kill -0 "$owner" 2>/dev/null; do sleep 1; done
            for pf in "$dir"/*/redis.pid; do kill -9 "$(cat "$pf")" 2>/dev/null; done
          ) >/dev/null 2>&1 </dev/null &
          echo $! >"$dir/watcher.pid"
        fi
        echo $ports
        exit 0
      fi
      cat "$dir/create.log" >&2
    fi
    stop_all
    rm -rf "${dir:?}"/[0-9]*
    [ -n "${KVR_CLUSTER_BASE:-}" ] && break
  done
  echo "redis-cluster: could not start a cluster" >&2
  exit 1
  ;;
stop)
  stop_all
  ;;
kill)
  port=${3:?port}
  pid=$(cat "$dir/$port/redis.pid" 2>/dev/null) && kill -9 "$pid" && touch "$dir/$port/dead"
  ;;
wait)
  wait_ok "${3:-40}"
  ;;
*)
  echo "usage: $0 start|stop|kill|wait DIR" >&2; exit 2 ;;
esac
