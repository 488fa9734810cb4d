#!/usr/bin/env bash
# A Ray head for local testing: dashboard + job API on 127.0.0.1, token auth on, worker nodes
# joining it on the same machine, and a `stop` that stops this head and its nodes only (never
# `ray stop`, which kills every Ray process on the machine).
#
#   eval "$(cluster/local_head.sh start --num-cpus 2)"     # start, then apply the printed exports
#   ray job submit --working-dir . -- python pipelines/three_stage.py \
#       --config pipelines/configs/debug.yaml storage_path=$PWD/runs
#   cluster/local_head.sh status
#   cluster/local_head.sh stop
#
# A multi-node cluster on one machine: a head with no CPUs, and worker nodes that join it:
#   eval "$(cluster/local_head.sh start --num-cpus 0)"
#   cluster/local_head.sh add-node --num-cpus 1             # prints the node's name: node-1
#   cluster/local_head.sh add-node --num-cpus 1             # node-2
#   cluster/local_head.sh stop-node node-1 [--kill]         # --kill: SIGKILL, as a machine lost
#
# start options:
#   --num-cpus N        CPUs the head offers (default 2)
#   --num-gpus N        GPUs the head offers (default: what Ray detects)
#   --port P            GCS port (default: a free port)
#   --dashboard-port D  dashboard / job API port on 127.0.0.1 (default: a free port)
#   --token-file F      use this token (kept as is; refused unless mode 0600/0400) instead of generating one
# add-node options (the node joins the head of --state-dir with its token):
#   --num-cpus N, --num-gpus N   what the node offers (default 1 CPU; GPUs: what Ray detects)
#   --object-store-memory B      its object store in bytes (default 300000000)
#   --resources JSON             custom resources, e.g. '{"big_mem": 1}'
# every command: --state-dir DIR (or CASCADE_HEAD_STATE_DIR), one folder per head
#   (default ${XDG_CACHE_HOME:-~/.cache}/cascade-ray/local-head); it holds the token (0600),
#   head.env (ports, session id, Ray temp dir), start.log, and nodes/<name>.env + .log per node.
# Ray and its Python: RAY (default: `ray` on PATH) and PYTHON (default: the python next to it).
#
# `start` prints only `export NAME=value` lines (and comments) on stdout, `add-node` only the
# node's name; progress goes to stderr.
#
# NETWORK EXPOSURE (Ray 2.60): only the dashboard / job API honours 127.0.0.1. The GCS, raylet,
# object manager, dashboard agent, runtime-env agent, Ray client server and the workers listen on
# ALL interfaces whatever --node-ip-address says. Token auth guards them, but the token travels in
# plaintext, and anyone who gets through can run code as you. This script pins every one of those
# ports (the nodes' too), and `status` prints a firewall rule that drops them on every interface
# but loopback, plus one for the ephemeral range torch.distributed's TCPStore and gloo pick their
# ports from (they cannot be pinned); or run the head and its clients in a network namespace with loopback only:
#   sudo unshare --net bash -c 'ip link set lo up; eval "$(cluster/local_head.sh start)"; ...'
# See docs/security.md.
set -euo pipefail

usage() { sed -n '2,44p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
log() { echo "local_head: $*" >&2; }
die() { echo "local_head: error: $*" >&2; exit 1; }

cmd=${1:-}
[ -n "$cmd" ] || usage
shift
state_dir=${CASCADE_HEAD_STATE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/cascade-ray/local-head}
num_cpus="" num_gpus="" port="" dash_port="" token_file="" object_store=300000000 resources="" kill=0 node_name=""
if [ "$cmd" = stop-node ] && [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then node_name=$1; shift; fi
while [ $# -gt 0 ]; do
  case "$1" in
    --state-dir) state_dir=$2; shift 2 ;;
    --num-cpus) num_cpus=$2; shift 2 ;;
    --object-store-memory) object_store=$2; shift 2 ;;
    --resources) resources=$2; shift 2 ;;
    --kill) kill=1; shift ;;
    --num-gpus) num_gpus=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --dashboard-port) dash_port=$2; shift 2 ;;
    --token-file) token_file=$2; shift 2 ;;
    -h|--help) usage ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

RAY=${RAY:-$(command -v ray || true)}
[ -n "$RAY" ] && [ -x "$RAY" ] || die "no \`ray\` on PATH: activate the venv, or set RAY=/path/to/venv/bin/ray"
PYTHON=${PYTHON:-$(dirname "$RAY")/python}
[ -x "$PYTHON" ] || PYTHON=$(command -v python3)
state_file=$state_dir/head.env

# --- the head's processes: everything in the session `ray start` ran in (workers call setpgid
# but keep the session), and their descendants (a job's entrypoint runs in a session of its own).
# `stop` ends them in Ray's own order (`ray stop`): raylet, then the rest, then the GCS, each
# group with SIGTERM and SIGKILL after 10 s; `kill` sends SIGKILL to all of them at once. What
# joins the session during the stop (a worker the raylet was forking) is stopped in later rounds.
# A worker node added by `add-node` is a session of its own, found the same way.
head_procs() {  # list|stop|kill SESSION_ID
  "$PYTHON" - "$@" <<'EOF'
import os, signal, sys, time
mode, sid, me = sys.argv[1], int(sys.argv[2]), os.getsid(0)

def scan():
    session, parent, name = {}, {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm = open(f"/proc/{pid}/comm").read().strip()
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":  # zombies are dead already
            p = int(pid)
            parent[p], session[p], name[p] = int(fields[1]), int(fields[3]), comm
    ours = {p for p, s in session.items() if s == sid != me}
    while more := {p for p, pp in parent.items() if pp in ours and session[p] != me} - ours:
        ours |= more
    return {p: name[p] for p in ours}

def alive(p):
    try:
        return open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

procs = scan()
if mode == "list":
    print("\n".join(map(str, sorted(procs))))
    sys.exit(0)


def end(procs):
    # kill: SIGKILL to all at once (a machine lost, for fault-tolerance tests); stop: Ray's order
    if mode == "kill":
        groups, signals = [list(procs)], ((signal.SIGKILL, 5.0),)
    else:
        groups = [[p for p, n in procs.items() if n == "raylet"], [p for p, n in procs.items() if n not in ("raylet", "gcs_server")], [p for p, n in procs.items() if n == "gcs_server"]]
        signals = ((signal.SIGTERM, 10.0), (signal.SIGKILL, 2.0))
    for group in groups:
        for sig, wait_s in signals:
            for p in group:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while (group := [p for p in group if alive(p)]) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not group:
                break
            if sig == signal.SIGTERM:
                print("local_head: SIGKILL to what ignored SIGTERM: " + " ".join(f"{p}({procs[p]})" for p in group), file=sys.stderr)

# A process can join the session after the scan: a worker the raylet forked as the stop began
# (its comm still "python3"). Up to 3 more rounds stop those before anything left is an error.
seen = dict(procs)
for round_ in range(4):
    if round_:
        print("local_head: stopping what started during the stop: " + " ".join(f"{p}({n})" for p, n in procs.items()), file=sys.stderr)
    end(procs)
    procs = scan()
    if not procs:
        break
    seen |= procs
left = {p: n for p, n in seen.items() if alive(p)}
if left:
    sys.exit("local_head: error: still alive: " + " ".join(f"{p}({n})" for p, n in left.items()))
EOF
}
head_pids() { head_procs list "$1"; }

# "$PYTHON" -c "$NEW_SESSION" SID_FILE CMD ...: run CMD in a new session (setsid in a forked
# child), its session id (= its pid) written to SID_FILE, so `stop` can find exactly the
# processes it started.
NEW_SESSION='
import os, sys
sid_file, argv = sys.argv[1], sys.argv[2:]
pid = os.fork()
if pid == 0:
    os.setsid()
    os.execv(argv[0], argv)
open(sid_file, "w").write(str(pid))
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
'

# pick_ports N [P ...]: the given ports (0: any free one), then N more free ports, then the first
# and last of a block of 64 free worker ports; all held open until all are chosen, so no two
# coincide.
pick_ports() {
  "$PYTHON" - "$@" <<'EOF'
import random, socket, sys
held = []
def take(p=0):
    s = socket.socket()
    try:
        s.bind(("", p))
    except OSError:
        sys.exit(f"local_head: error: port {p} is in use")
    held.append(s)
    return s.getsockname()[1]
ports = [take(int(p)) for p in sys.argv[2:]] + [take() for _ in range(int(sys.argv[1]))]
for _ in range(200):
    lo = random.randrange(20000, 60000 - 64)
    try:
        block = [take(p) for p in range(lo, lo + 64)]
        break
    except SystemExit:
        continue
else:
    sys.exit("local_head: error: no block of 64 free worker ports found")
print(*ports, lo, lo + 63)
EOF
}

load_state() {
  [ -f "$state_file" ] || return 1
  # shellcheck disable=SC1090
  . "$state_file"
}

api_get() {  # $1 url path; prints the HTTP status (000 when unreachable)
  "$PYTHON" - "$DASHBOARD_PORT" "$1" "$TOKEN_PATH" <<'EOF'
import sys, urllib.request, urllib.error
port, path, token_path = sys.argv[1:]
req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Authorization": "Bearer " + open(token_path).read().strip()})
try:
    print(urllib.request.urlopen(req, timeout=3).status)
except urllib.error.HTTPError as e:
    print(e.code)
except Exception:
    print("000")
EOF
}

firewall_hint() {
  echo "# keep this head's ports off the network (Ray binds them on all interfaces):"
  echo "#   iptables -I INPUT ! -i lo -p tcp -m multiport --dports ${PRIVATE_PORTS} -j DROP"
  echo "#   iptables -I INPUT ! -i lo -p tcp --dport ${WORKER_PORTS} -j DROP"
  for f in "$state_dir"/nodes/*.env; do
    [ -e "$f" ] || continue
    (
      . "$f"
      echo "#   iptables -I INPUT ! -i lo -p tcp -m multiport --dports ${NODE_PRIVATE_PORTS} -j DROP  # $NODE_NAME"
      echo "#   iptables -I INPUT ! -i lo -p tcp --dport ${NODE_WORKER_PORTS} -j DROP  # $NODE_NAME"
    )
  done
  # torch.distributed (Ray Train's TCPStore on rank 0, gloo's pair sockets) binds ephemeral ports
  # on all interfaces; Ray has no knob to pin them. NEW only: replies to this host's own outgoing
  # connections arrive on the same range.
  local eph
  eph=$(tr -s '[:space:]' ':' </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null | sed 's/:$//')
  echo "#   iptables -I INPUT ! -i lo -p tcp --dport ${eph:-32768:60999} -m conntrack --ctstate NEW -j DROP  # torch.distributed"
}

# --- worker nodes added by `add-node`: one record each, $state_dir/nodes/<name>.env
node_running() {  # FILE
  local sid
  sid=$(sed -n 's/^NODE_SESSION_ID=//p' "$1")
  [ "${sid:-0}" -gt 1 ] && [ -n "$(head_pids "$sid")" ]
}
forget_node() {  # FILE: remove the record and the node's temp dir
  local tmp
  tmp=$(. "$1" && echo "$NODE_TEMP_DIR")
  case "$tmp" in /tmp/crn-*) rm -rf "$tmp" ;; esac
  rm -f "$1" "${1%.env}.sid"
}
end_node() {  # FILE stop|kill
  local sid name
  sid=$(sed -n 's/^NODE_SESSION_ID=//p' "$1") name=$(basename "$1" .env)
  [ "${sid:-0}" -gt 1 ] || die "bad NODE_SESSION_ID in $1"
  if [ -n "$(head_pids "$sid")" ]; then
    log "$([ "$2" = kill ] && echo killing || echo stopping) node $name: $(head_pids "$sid" | wc -l) processes of session $sid"
    head_procs "$2" "$sid" || die "could not $2 node $name (session $sid)"
  fi
  forget_node "$1"
}

case "$cmd" in
start)
  if load_state && [ -n "$(head_pids "$SESSION_ID")" ]; then
    die "a head from $state_dir is already running (dashboard 127.0.0.1:$DASHBOARD_PORT); stop it first or pick another --state-dir"
  fi
  num_cpus=${num_cpus:-2}
  [[ "$num_cpus" =~ ^[0-9]+$ ]] || die "--num-cpus must be a whole number, not '$num_cpus'"
  for f in "$state_dir"/nodes/*.env; do
    [ -e "$f" ] || continue
    node_running "$f" && die "node $(basename "$f" .env) of an earlier head in $state_dir still runs; \`$0 stop\` first"
    forget_node "$f"
  done
  mkdir -p "$state_dir"
  chmod 700 "$state_dir"
  rm -f "$state_file"

  if [ -n "$token_file" ]; then
    [ -s "$token_file" ] || die "--token-file $token_file is missing or empty"
    token_path=$(cd "$(dirname "$token_file")" && pwd)/$(basename "$token_file")
    # refused, not warned: whoever can read the token can run code on the cluster
    case "$(stat -c %a "$token_path")" in *00) ;; *) die "--token-file $token_path is readable by group/others; chmod 600 $token_path" ;; esac
    own_token=0
  else
    token_path=$state_dir/auth_token
    (umask 077 && "$PYTHON" -c 'import secrets; print(secrets.token_hex(32), end="")' >"$token_path")
    own_token=1
  fi

  # Ports: the chosen ones must be free; the rest are picked free, plus a block of 64 worker ports.
  read -r port dash_port client_port agent_port agent_grpc_port env_agent_port metrics_port nm_port om_port worker_lo worker_hi < <(
    pick_ports 7 "${port:-0}" "${dash_port:-0}") || die "could not pick ports"
  [ -n "${worker_hi:-}" ] || die "could not pick ports"

  temp_dir=$(mktemp -d /tmp/crh-XXXXXX)  # short: Ray's unix sockets live under it (108-byte limit)
  sid_file=$state_dir/session_id
  gpu_args=()
  [ -z "$num_gpus" ] || gpu_args=(--num-gpus "$num_gpus")
  log "starting Ray head: GCS :$port, dashboard 127.0.0.1:$dash_port, $num_cpus CPU(s), temp dir $temp_dir"
  # A new session (NEW_SESSION) so `stop` can find exactly this head's processes.
  # RAY_AUTH_TOKEN would override the token file; RAY_ADDRESS would point at another cluster.
  if ! env -u RAY_AUTH_TOKEN -u RAY_ADDRESS RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$token_path" \
      "$PYTHON" -c "$NEW_SESSION" "$sid_file" "$RAY" start --head --disable-usage-stats \
      --num-cpus "$num_cpus" "${gpu_args[@]}" --temp-dir "$temp_dir" \
      --port "$port" --dashboard-host 127.0.0.1 --dashboard-port "$dash_port" --include-dashboard true \
      --ray-client-server-port "$client_port" --dashboard-agent-listen-port "$agent_port" \
      --dashboard-agent-grpc-port "$agent_grpc_port" --runtime-env-agent-port "$env_agent_port" \
      --metrics-export-port "$metrics_port" --node-manager-port "$nm_port" --object-manager-port "$om_port" \
      --min-worker-port "$worker_lo" --max-worker-port "$worker_hi" \
      >"$state_dir/start.log" 2>&1
  then
    cat "$state_dir/start.log" >&2
    session=$(cat "$sid_file" 2>/dev/null || echo 0)
    [ "$session" -gt 1 ] && head_pids "$session" | xargs -r kill -KILL 2>/dev/null || true
    rm -rf "$temp_dir"
    die "ray start failed (log above, also in $state_dir/start.log)"
  fi
  session=$(cat "$sid_file")
  {
    printf 'TEMP_DIR=%q\nTOKEN_PATH=%q\n' "$temp_dir" "$token_path"  # paths quoted: the file is sourced
    echo "SESSION_ID=$session"
    echo "GCS_PORT=$port"
    echo "DASHBOARD_PORT=$dash_port"
    echo "OWN_TOKEN=$own_token"
    echo "NUM_CPUS=$num_cpus"
    echo "PRIVATE_PORTS=$port,$client_port,$agent_port,$agent_grpc_port,$env_agent_port,$metrics_port,$nm_port,$om_port"
    echo "WORKER_PORTS=$worker_lo:$worker_hi"
  } >"$state_file"
  load_state
  for _ in $(seq 60); do
    [ "$(api_get /api/version)" = 200 ] && break
    sleep 1
  done
  if [ "$(api_get /api/version)" != 200 ]; then
    cp "$TEMP_DIR/session_latest/logs/dashboard.log" "$state_dir/dashboard.log" 2>/dev/null || true
    head_procs stop "$SESSION_ID" || true
    rm -rf "$TEMP_DIR" && rm -f "$state_file"
    die "the job API on 127.0.0.1:$DASHBOARD_PORT did not answer within 60 s; head stopped (its dashboard log: $state_dir/dashboard.log)"
  fi
  log "head up (session $SESSION_ID); stop it with: $0 stop --state-dir $state_dir"
  [ -z "${RAY_AUTH_TOKEN:-}" ] || echo "unset RAY_AUTH_TOKEN  # it would override RAY_AUTH_TOKEN_PATH"
  echo "export RAY_ADDRESS=http://127.0.0.1:$DASHBOARD_PORT"
  echo "export RAY_AUTH_MODE=token"
  echo "export RAY_AUTH_TOKEN_PATH=$TOKEN_PATH"
  echo "# a driver on this machine (no job) connects with: --address 127.0.0.1:$GCS_PORT"
  firewall_hint
  ;;
add-node)
  load_state || die "no head recorded in $state_dir: \`$0 start\` one first"
  [ -n "$(head_pids "$SESSION_ID")" ] || die "the head recorded in $state_dir is not running"
  num_cpus=${num_cpus:-1}
  [[ "$num_cpus" =~ ^[0-9]+$ ]] || die "--num-cpus must be a whole number, not '$num_cpus'"
  [[ "$object_store" =~ ^[0-9]+$ ]] || die "--object-store-memory must be a number of bytes, not '$object_store'"
  mkdir -p "$state_dir/nodes"
  n=1
  while [ -e "$state_dir/nodes/node-$n.env" ] || [ -e "$state_dir/nodes/node-$n.sid" ]; do n=$((n + 1)); done
  name=node-$n
  read -r nm_port om_port agent_port agent_grpc_port env_agent_port metrics_port worker_lo worker_hi < <(
    pick_ports 6) || die "could not pick ports"
  [ -n "${worker_hi:-}" ] || die "could not pick ports"
  # its own short temp dir (Ray 2.60 takes --temp-dir per node): sockets, logs and the
  # runtime-env downloads of this node, removed by stop
  temp_dir=$(mktemp -d /tmp/crn-XXXXXX)
  extra=()
  [ -z "$num_gpus" ] || extra+=(--num-gpus "$num_gpus")
  [ -z "$resources" ] || extra+=(--resources "$resources")
  log "adding $name to the head at 127.0.0.1:$GCS_PORT: $num_cpus CPU(s), object store $object_store bytes, temp dir $temp_dir"
  if ! env -u RAY_AUTH_TOKEN -u RAY_ADDRESS RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$TOKEN_PATH" \
      "$PYTHON" -c "$NEW_SESSION" "$state_dir/nodes/$name.sid" "$RAY" start --address "127.0.0.1:$GCS_PORT" --disable-usage-stats \
      --num-cpus "$num_cpus" "${extra[@]}" --object-store-memory "$object_store" --temp-dir "$temp_dir" \
      --node-manager-port "$nm_port" --object-manager-port "$om_port" \
      --dashboard-agent-listen-port "$agent_port" --dashboard-agent-grpc-port "$agent_grpc_port" \
      --runtime-env-agent-port "$env_agent_port" --metrics-export-port "$metrics_port" \
      --min-worker-port "$worker_lo" --max-worker-port "$worker_hi" \
      >"$state_dir/nodes/$name.log" 2>&1
  then
    cat "$state_dir/nodes/$name.log" >&2
    session=$(cat "$state_dir/nodes/$name.sid" 2>/dev/null || echo 0)
    [ "$session" -gt 1 ] && head_procs kill "$session" || true
    rm -rf "$temp_dir" "$state_dir/nodes/$name.sid"
    die "ray start of $name failed (log above, also in $state_dir/nodes/$name.log)"
  fi
  session=$(cat "$state_dir/nodes/$name.sid")
  # the node's Ray id (what ray.nodes() and summary.json call it), from its raylet's log
  node_id=$(grep -ohE "[Nn]ode[ _]?[Ii][Dd][:= ]+[0-9a-f]{56}" "$temp_dir"/session_latest/logs/raylet.out 2>/dev/null | grep -oE "[0-9a-f]{56}" | head -1 || true)
  {
    printf 'NODE_NAME=%s\nNODE_TEMP_DIR=%q\n' "$name" "$temp_dir"
    echo "NODE_SESSION_ID=$session"
    echo "NODE_ID=$node_id"
    echo "NODE_CPUS=$num_cpus"
    echo "NODE_PRIVATE_PORTS=$nm_port,$om_port,$agent_port,$agent_grpc_port,$env_agent_port,$metrics_port"
    echo "NODE_WORKER_PORTS=$worker_lo:$worker_hi"
  } >"$state_dir/nodes/$name.env"
  log "$name up (session $session, node id ${node_id:-unknown}); stop it with: $0 stop-node $name --state-dir $state_dir"
  echo "$name"
  ;;
stop-node)
  [ -n "$node_name" ] || die "stop-node needs a node name (see \`$0 status\`)"
  [ -f "$state_dir/nodes/$node_name.env" ] || die "no node $node_name recorded in $state_dir/nodes"
  end_node "$state_dir/nodes/$node_name.env" "$([ "$kill" = 1 ] && echo kill || echo stop)"
  log "$node_name $([ "$kill" = 1 ] && echo killed || echo stopped)"
  ;;
status)
  load_state || { echo "no head recorded in $state_dir"; exit 3; }
  pids=$(head_pids "$SESSION_ID")
  if [ -z "$pids" ]; then
    echo "not running (recorded in $state_dir; \`$0 stop\` clears it)"
    exit 3
  fi
  echo "running: $(echo "$pids" | wc -l) processes in session $SESSION_ID, $NUM_CPUS CPU(s)"
  echo "job API http://127.0.0.1:$DASHBOARD_PORT (GET /api/version with the token: $(api_get /api/version)), GCS port $GCS_PORT, temp dir $TEMP_DIR"
  for f in "$state_dir"/nodes/*.env; do
    [ -e "$f" ] || continue
    (
      . "$f"
      node_pids=$(head_pids "$NODE_SESSION_ID")
      if [ -n "$node_pids" ]; then
        echo "$NODE_NAME: running: $(echo "$node_pids" | wc -l) processes in session $NODE_SESSION_ID, $NODE_CPUS CPU(s), node id ${NODE_ID:-unknown}"
      else
        echo "$NODE_NAME: not running (\`$0 stop-node $NODE_NAME\` clears it)"
      fi
    )
  done
  firewall_hint
  ;;
stop)
  for f in "$state_dir"/nodes/*.env; do  # the nodes first: they would only retry the GCS once the head is gone
    [ -e "$f" ] || continue
    end_node "$f" stop
  done
  load_state || { log "no head recorded in $state_dir: nothing to stop"; exit 0; }
  [ "${SESSION_ID:-0}" -gt 1 ] || die "bad SESSION_ID in $state_file"
  pids=$(head_pids "$SESSION_ID")
  if [ -n "$pids" ]; then
    log "stopping $(echo "$pids" | wc -l) processes of session $SESSION_ID"
    head_procs stop "$SESSION_ID" || die "could not stop session $SESSION_ID"
  fi
  case "$TEMP_DIR" in /tmp/crh-*) rm -rf "$TEMP_DIR" ;; esac
  [ "${OWN_TOKEN:-0}" != 1 ] || rm -f "$TOKEN_PATH"
  rm -f "$state_file" "$state_dir/session_id"
  log "stopped"
  ;;
*) usage ;;
esac
