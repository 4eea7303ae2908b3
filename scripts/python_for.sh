#!/usr/bin/env bash
# The newest Python on this machine that can run a stack (keras3: 3.12-3.10, keras2: 3.11-3.9): its path,
# or nothing (exit 1). Looks on PATH, then in pyenv's versions (whose shims answer only for the active one).
stack=${1:?usage: scripts/python_for.sh keras3|keras2}
case "$stack" in
  keras3) versions="3.12 3.11 3.10" ;;
  keras2) versions="3.11 3.10 3.9" ;;
  *) echo "scripts/python_for.sh: unknown stack $stack" >&2; exit 2 ;;
esac
for v in $versions; do
  if command -v "python$v" >/dev/null && "python$v" -c "" 2>/dev/null; then command -v "python$v"; exit 0; fi
  if command -v pyenv >/dev/null; then
    for p in "$(pyenv root)"/versions/"$v"*/bin/python"$v"; do
      [ -x "$p" ] && { echo "$p"; exit 0; }
    done
  fi
done
exit 1
