#!/usr/bin/env bash
# What a newcomer waits for, measured on fresh clones of this repo: `make demo`, then `make test`, then each
# installer's two installs with its cache off (uv, then pip), side by side. Usage:
#   scripts/time_fresh_clone.sh [OUT_DIR]     (default /tmp/kava-timing; the figures land in OUT_DIR/times.txt)
# COLD=0 skips the cache-off installs; TEST_ARGS are passed to `make test` (e.g. TEST_ARGS="TEST_WORKERS=3
# PYTEST_ARGS=--junitxml=/tmp/suite.xml" for every test's seconds).
# Run it with nothing else on the machine: it times the box as much as the code.
set -u
SRC=$(cd "$(dirname "$0")/.." && pwd)
R=${1:-/tmp/kava-timing}
rm -rf "$R" && mkdir -p "$R"
git clone -q "$SRC" "$R/clone" && git -C "$R/clone" log --oneline -1 > "$R/commit.txt"
cd "$R/clone"
s=$(date +%s); make demo > "$R/demo.out" 2>&1; echo "make demo rc $? $(( $(date +%s) - s )) s" > "$R/times.txt"
s=$(date +%s); make test ${TEST_ARGS:-} > "$R/test.out" 2>&1; echo "make test rc $? $(( $(date +%s) - s )) s" >> "$R/times.txt"
for inst in $( [ "${COLD:-1}" = 0 ] || echo uv pip ); do
  git clone -q "$SRC" "$R/cold-$inst" && cd "$R/cold-$inst"
  s=$(date +%s); UV_NO_CACHE=1 PIP_NO_CACHE_DIR=1 make .venv/.kava-base INSTALLER=$inst > "$R/$inst-base.out" 2>&1
  echo "$inst, cache off: the demo's install rc $? $(( $(date +%s) - s )) s" >> "$R/times.txt"
  s=$(date +%s); UV_NO_CACHE=1 PIP_NO_CACHE_DIR=1 make .venv/.kava-installed INSTALLER=$inst > "$R/$inst-full.out" 2>&1
  echo "$inst, cache off: the tests' extras rc $? $(( $(date +%s) - s )) s" >> "$R/times.txt"
  cd "$R" && rm -rf "$R/cold-$inst"
done
cat "$R/times.txt"
