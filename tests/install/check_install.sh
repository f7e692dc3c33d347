#!/usr/bin/env bash
# check_install.sh python|cpp — runs README.md's Install lines as they are written, as a user on a
# plain box would, then the README's two-process example with what they installed.
#
#   python  the block marked file=install-python.sh (apt-get, a fresh venv of Debian's Python, the
#           pip line: pip always builds CPU-only), then engine.py and trainer.py with that venv's
#           python, from a directory outside the checkout (so `import refit` is the installed one);
#   cpp     the block marked file=install-cpp.sh (the library alone into a private prefix), then
#           engine.cpp and trainer.cpp compiled and run with the lines of that block.
#
# Both run with the CUDA toolkit off PATH (a user's box has no nvcc), HOME in a scratch directory,
# from a copy of the checkout's files (what git tracks, and new files it does not ignore). The two processes must print the same fingerprint for each of the
# three versions. tools/dev test runs both (CI: .ci/run).
set -euo pipefail

what=${1:?usage: check_install.sh python|cpp}
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/refit-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/home" "$tmp/blocks" "$tmp/run"

# The checkout as it is now (tracked and untracked files, not what git ignores), copied: the blocks
# run from the copy, so that edits made meanwhile cannot reach a half-done build, and the copy's
# build directories go with it.
src="$tmp/checkout"
mkdir -p "$src"
(cd "$root" && git ls-files -co --exclude-standard -z | tar --null --ignore-failed-read -cf - -T - 2>/dev/null) |
  tar -xf - -C "$src"

for lang in sh python cpp; do
  /usr/bin/python3 "$root/tests/readme/readme_blocks.py" --lang "$lang" --out "$tmp/blocks" "$root/README.md" >/dev/null
done
# No CUDA toolkit: its directories off PATH, and an nvcc first on PATH that fails (some boxes link
# one into /usr/local/bin), so that Meson finds none.
mkdir -p "$tmp/no-cuda"
printf '#!/bin/sh\necho "nvcc: not on this box (tests/install/check_install.sh)" >&2\nexit 127\n' >"$tmp/no-cuda/nvcc"
chmod +x "$tmp/no-cuda/nvcc"
plain_path="$tmp/no-cuda:$(printf '%s' "$PATH" | tr ':' '\n' | grep -v -i cuda | paste -sd: -)"

# run_block NAME — the README's block NAME, in bash with errexit, as a user pasting it would see it stop.
run_block() {
  [[ -f "$tmp/blocks/$1" ]] || { echo "check_install.sh: README.md has no block marked file=$1" >&2; exit 1; }
  echo "== README.md, $1:"
  sed 's/^/   /' "$tmp/blocks/$1"
  (cd "$src" && env HOME="$tmp/home" PATH="$plain_path" bash -euo pipefail "$tmp/blocks/$1")
}

# same_fingerprints ENGINE_OUT TRAINER_OUT — three versions, the same fingerprint on both sides.
same_fingerprints() {
  local e t
  e=$(grep -E '^version [0-9]+: fingerprint ' "$1" || true)
  t=$(grep -E '^version [0-9]+: fingerprint ' "$2" || true)
  if [[ $(wc -l <<<"$t") -ne 3 || "$e" != "$t" ]]; then
    echo "check_install.sh: the fingerprints differ or are missing:"; echo "-- engine:"; cat "$1"
    echo "-- trainer:"; cat "$2"; exit 1
  fi
  echo "== both sides printed the same three fingerprints:"; sed 's/^/   /' <<<"$t"
}

# pair ENGINE... -- TRAINER... — the engine in the background, then the trainer, as the README says.
pair() {
  local engine_cmd=() trainer_cmd=()
  while [[ $1 != -- ]]; do engine_cmd+=("$1"); shift; done
  shift
  trainer_cmd=("$@")
  (cd "$tmp/run" && exec env HOME="$tmp/home" PATH="$plain_path" "${engine_cmd[@]}" "$tmp/run/endpoint") \
    >"$tmp/engine.out" 2>&1 &
  local engine=$!
  if ! (cd "$tmp/run" && env HOME="$tmp/home" PATH="$plain_path" timeout 300 "${trainer_cmd[@]}" "$tmp/run/endpoint") \
       >"$tmp/trainer.out" 2>&1; then
    kill "$engine" 2>/dev/null || true
    echo "check_install.sh: the trainer failed:"; cat "$tmp/trainer.out" "$tmp/engine.out"; exit 1
  fi
  if ! timeout 60 tail --pid="$engine" -f /dev/null; then
    kill "$engine" 2>/dev/null || true
    echo "check_install.sh: the engine did not end after the trainer closed its streamer:"; cat "$tmp/engine.out"
    exit 1
  fi
  wait "$engine" || { echo "check_install.sh: the engine failed:"; cat "$tmp/engine.out"; exit 1; }
  same_fingerprints "$tmp/engine.out" "$tmp/trainer.out"
}

case $what in
  python)
    run_block install-python.sh
    py="$tmp/home/refit-env/bin/python"
    [[ -x $py ]] || { echo "check_install.sh: the block made no venv at ~/refit-env" >&2; exit 1; }
    cp "$tmp/blocks/engine.py" "$tmp/blocks/trainer.py" "$tmp/run/"
    pair "$py" engine.py -- "$py" trainer.py
    ;;
  cpp)
    # The library alone, from the checkout into ~/.local; the programs then compiled as the C++
    # example says (its `c++` lines), with the block's exports, where the programs are saved.
    run_block install-cpp.sh
    exports=$(grep -E '^export ' "$tmp/blocks/install-cpp.sh" || true)
    compiles=$(grep -E '^c\+\+ ' "$tmp/blocks/run-cpp.sh" || true)
    [[ -n $compiles ]] || { echo "check_install.sh: the block file=run-cpp.sh has no c++ line" >&2; exit 1; }
    cp "$tmp/blocks/engine.cpp" "$tmp/blocks/trainer.cpp" "$tmp/run/"
    echo "== in the programs' directory:"; sed 's/^/   /' <<<"$exports"$'\n'"$compiles"
    (cd "$tmp/run" && env HOME="$tmp/home" PATH="$plain_path" bash -euo pipefail -c "$exports"$'\n'"$compiles")
    # (A newline after the exports: the README's line ends with a comment.)
    pair bash -c "$exports"$'\n''exec ./engine "$1"' engine -- bash -c "$exports"$'\n''exec ./trainer "$1"' trainer
    ;;
  *) echo "usage: check_install.sh python|cpp" >&2; exit 2 ;;
esac
echo "== check_install.sh $what: passed"
