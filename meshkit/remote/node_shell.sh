#!/bin/sh
# meshkit's node shell (remote/node_shell.py): started once per node as `sh -c SCRIPT meshkit
# TOKEN`, it answers one request per line, in order. Every request line starts with TOKEN.
exec 2>/dev/null
umask 077
set -C
T=$1 w=
trap '[ -z "$w" ] || kill "$w"' EXIT
txt() {
  n=0
  while [ "$n" -lt "$2" ] && { IFS= read -r l || [ -n "$l" ]; }; do
    n=$((n + 1)); printf '|%s\n' "$l"
  done < "$1"
}
fin() { case $2 in -) ;; !) rm -f -- "$1" ;; *) mv -f -- "$2" "$1" ;; esac; }
drop() { case $1 in -|!) ;; *) rm -f -- "$1" ;; esac; }
echo '=meshkit-ready'
while read -r t op a b; do
  [ "$t" = "$T" ] || exit 1
  case $op in
  cat|txt)
    if [ ! -e "$b" ]; then echo '=none'
    elif [ ! -r "$b" ]; then echo '=denied'
    elif [ "$op" = txt ]; then echo '=ok'; txt "$b" "$a"
    else echo '=ok'; head -c "$a" -- "$b" </dev/null | base64; fi ;;
  stat)
    echo '=ok'; set -f
    # $b is several paths, split on purpose (globbing is off: set -f).
    # shellcheck disable=SC2086
    if [ "$a" = -L ]; then stat -L -c '|%f %u %n' -- $b; else stat -c '|%f %u %n' -- $b; fi
    set +f ;;
  link) echo '=ok'; printf '|%s\n' "$(readlink -- "$b")" ;;
  ls)
    if [ -d "$b" ]; then
      echo '=ok'
      for f in "$b"/* "$b"/.[!.]* "$b"/..?*; do
        if [ -e "$f" ] || [ -L "$f" ]; then printf '|%s\n' "${f##*/}"; fi
      done
    else echo '=none'; fi ;;
  home) cd -P . && echo "=ok $PWD" ;;
  keygen)
    k=${a%%:*} c=${a#*:} r=0 out=
    [ -d .ssh ] || mkdir -m 700 .ssh
    exec 8<.ssh
    if flock -w 30 8; then
      if [ "$k" = derive ]; then
        if [ ! -e "$b.pub" ]; then
          out=$(ssh-keygen -y -f "$b" 2>&1 >"$b.pub" </dev/null) || { r=$?; rm -f -- "$b.pub"; }
        fi
      elif [ ! -e "$b" ] && [ ! -e "$b.pub" ]; then
        out=$(ssh-keygen -q -t "$k" -N '' -C "$c" -f "$b" 2>&1 </dev/null) || r=$?
      fi
      exec 8<&-
      if [ "$r" = 0 ] && [ -r "$b.pub" ]; then echo '=ok'; txt "$b.pub" 4
      else echo "=err $r"; printf '%s\n' "$out" | head -c 300 | base64; fi
    else exec 8<&-; echo "=err lock"; fi ;;
  lock)
    [ -d .ssh ] || mkdir -m 700 .ssh
    exec 9<.ssh
    if flock -w "$a" 9; then
      (exec 8<&- 9<&-; trap 'kill $s; exit' TERM; sleep "$a" & s=$!; wait $s; kill -TERM $$) \
        </dev/null >/dev/null &
      w=$!
      echo '=ok'
    else exec 9<&-; echo '=err'; fi ;;
  unlock) exec 9<&-; [ -z "$w" ] || kill "$w"; w=; echo '=ok' ;;
  put) if head -c "$a" > "$b"; then echo '=ok'; else exit 1; fi ;;
  commit)
    read -r ta tk
    ha=none hk=none p=
    for x in $(sha256sum -- .ssh/authorized_keys .ssh/known_hosts); do
      case $x in .ssh/authorized_keys) ha=$p ;; .ssh/known_hosts) hk=$p ;; esac
      p=$x
    done
    if [ "$ha" = "$a" ] && [ "$hk" = "$b" ]; then
      if fin .ssh/authorized_keys "$ta" && fin .ssh/known_hosts "$tk"; then echo '=ok'
      else echo '=err'; fi
    else drop "$ta"; drop "$tk"; echo '=changed'; fi ;;
  rm) rm -f -- "$b"; echo '=ok' ;;
  sh) s=$(head -c "$a"); echo '=ok'; sh -c "$s" </dev/null 2>&1 | base64 ;;
  *) echo '=err' ;;
  esac
  echo .
done
