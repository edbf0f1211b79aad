#!/usr/bin/env bash
# Runs every ```sh block of docs/guide/*.md, in order, from the repository
# root, each in its own `bash -e` (a block may rely on the ones before it in
# its page). ```console blocks (mpirun, GPUs, several terminals) are not run.
# Prints one line per block and ends with the count of failures; the exit
# status is non-zero if any block failed. Needs build/memfl (make build).
#   scripts/check-guides.sh [PAGE.md ...]
set -uo pipefail
cd "$(dirname "$0")/.."
# The guides' python3 is Debian's, with python3-torch (scripts/install-deps.sh);
# a python3 from elsewhere earlier on PATH (pyenv) has no torch.
export PATH=/usr/bin:$PATH
pages=("$@")
[ ${#pages[@]} -eq 0 ] && pages=(docs/guide/*.md)
fail=0
total=0
for page in "${pages[@]}"; do
  n=0
  while IFS= read -r -d '' block; do
    n=$((n + 1))
    total=$((total + 1))
    start=$SECONDS
    if out=$(bash -e -c "$block" 2>&1); then
      printf 'ok    %-28s block %d (%d s)\n' "$(basename "$page")" "$n" "$((SECONDS - start))"
    else
      fail=$((fail + 1))
      printf 'FAIL  %-28s block %d\n' "$(basename "$page")" "$n"
      printf '%s\n' "$block" | sed 's/^/    $ /'
      printf '%s\n' "$out" | tail -20 | sed 's/^/    | /'
    fi
  done < <(awk 'BEGIN{inb=0} /^```sh[[:space:]]*$/{inb=1; buf=""; next} /^```/{if(inb){printf "%s%c", buf, 0}; inb=0; next} inb{buf=buf $0 "\n"}' "$page")
done
echo "check-guides: $((total - fail)) of $total blocks passed"
[ "$fail" -eq 0 ]
