#!/usr/bin/env bash
# A skilled user's parallel mesh in bash: one multiplexed SSH master per node (ControlMaster), a
# parallel round collecting each node's user key and host keys, a parallel round merging every
# key into every authorized_keys / known_hosts (by name and address, idempotently), masters closed.
# usage: mesh_bash.sh SSH_CONFIG WORKDIR NAME=ADDRESS...
set -euo pipefail
cfg=$1 work=$2
shift 2
mkdir -p "$work/cm" "$work/keys"
opts=(-F "$cfg" -o BatchMode=yes -o StrictHostKeyChecking=yes -o ConnectTimeout=30
      -o ControlMaster=auto -o "ControlPath=$work/cm/%C" -o ControlPersist=30)

collect='test -f ~/.ssh/id_ed25519 || ssh-keygen -q -t ed25519 -N "" -f ~/.ssh/id_ed25519
cat ~/.ssh/id_ed25519.pub; cat /etc/ssh/ssh_host_*_key.pub'
pids=()
for spec in "$@"; do
  name=${spec%%=*}
  timeout 120 ssh "${opts[@]}" "$name" "$collect" >"$work/keys/$name" 2>"$work/keys/$name.err" </dev/null &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done

: >"$work/merge"
for spec in "$@"; do head -n 1 "$work/keys/${spec%%=*}" >>"$work/merge"; done
echo -- >>"$work/merge"
for spec in "$@"; do
  name=${spec%%=*} addr=${spec#*=}
  tail -n +2 "$work/keys/$name" | awk -v h="$name,$addr" '{print h, $1, $2}' >>"$work/merge"
done

merge='umask 077; a=~/.ssh/authorized_keys; k=~/.ssh/known_hosts; touch "$a" "$k"; f=$a
while IFS= read -r l; do
  if [ "$l" = "--" ]; then f=$k; continue; fi
  grep -qxF -- "$l" "$f" || printf "%s\n" "$l" >>"$f"
done'
pids=()
for spec in "$@"; do
  name=${spec%%=*}
  timeout 120 ssh "${opts[@]}" "$name" "$merge" <"$work/merge" >/dev/null 2>>"$work/keys/$name.err" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done

for spec in "$@"; do ssh "${opts[@]}" -O exit "${spec%%=*}" 2>/dev/null & done
wait
