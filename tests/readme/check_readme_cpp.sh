#!/usr/bin/env bash
# check_readme_cpp.sh — compiles every ```cpp block of README.md (unit suite, tests/meson.build).
#
# tests/readme/readme_blocks.py writes each block (with the blocks that continue it) as one
# translation unit; the README says how with an HTML comment before a block:
#   <!-- README-test: fragment -->    statements: wrapped in a function, after the placeholders of
#                                      tests/readme/readme_prelude.hpp (declare new ones there)
#   <!-- README-test: continues -->   goes on from the previous C++ block (same function body)
#   (none)                             a whole translation unit
#   <!-- README-test: file=NAME -->   a whole program file; engine.cpp and trainer.cpp are then also
#                                      linked and run as a pair (below)
# Each is compiled as a user would, with the project's compiler against the public headers of
# the source tree only: -std=c++20 -Wall -Wextra -Wpedantic -Werror -I include. Diagnostics name
# README.md lines (#line). Fails when any block fails, or when none was found.
#
# Environment (set by tests/meson.build): REFIT_SOURCE_ROOT, REFIT_BUILD_ROOT, REFIT_SANITIZE, CXX (words
# split), PYTHON.
set -euo pipefail

src=${REFIT_SOURCE_ROOT:?}
read -r -a cxx <<<"${CXX:?}"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/refit-readme.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

mapfile -t files < <("${PYTHON:?}" "$src/tests/readme/readme_blocks.py" --lang cpp \
  --prelude "$src/tests/readme/readme_prelude.hpp" --out "$tmp" "$src/README.md")
[[ ${#files[@]} -gt 0 ]] || { echo "check_readme_cpp.sh: no C++ block found in README.md" >&2; exit 1; }

failed=0
for f in "${files[@]}"; do
  block=$(basename "$f" .cpp)
  if "${cxx[@]}" -std=c++20 -Wall -Wextra -Wpedantic -Werror -I "$src/include" -c "$f" -o "$f.o" \
       2>"$f.log"; then
    echo "README.md:${block#block_}: ok"
  else
    echo "README.md:${block#block_}: FAILED"
    sed 's/^/  /' "$f.log"
    echo "  -- the translation unit compiled:"
    cat -n "$f" | sed 's/^/  /'
    failed=1
  fi
done
[[ $failed -eq 0 ]] || exit 1

# The complete pair (the blocks marked file=engine.cpp and file=trainer.cpp) runs as the README says:
# linked against the build's librefit.so, the engine in the background, then the trainer; the
# fingerprints both print must be the same. Not in a sanitizer build (an instrumented librefit
# needs the programs built with the same runtime).
if [[ -f "$tmp/engine.cpp" && -f "$tmp/trainer.cpp" && "${REFIT_SANITIZE:-none}" == none && -n "${REFIT_BUILD_ROOT:-}" ]]; then
  for p in engine trainer; do
    "${cxx[@]}" -pthread "$tmp/$p.cpp.o" -o "$tmp/$p" -L "$REFIT_BUILD_ROOT" -lrefit \
      -Wl,-rpath,"$REFIT_BUILD_ROOT" || { echo "README.md: linking $p.cpp FAILED"; exit 1; }
  done
  "$tmp/engine" "$tmp/endpoint" >"$tmp/engine.out" 2>&1 &
  engine=$!
  if ! timeout 120 "$tmp/trainer" "$tmp/endpoint" >"$tmp/trainer.out" 2>&1; then
    kill "$engine" 2>/dev/null
    echo "README.md: the C++ trainer FAILED:"; cat "$tmp/trainer.out" "$tmp/engine.out"; exit 1
  fi
  timeout 60 tail --pid="$engine" -f /dev/null || { kill "$engine"; echo "README.md: the C++ engine did not end"; exit 1; }
  wait "$engine" || { echo "README.md: the C++ engine FAILED:"; cat "$tmp/engine.out"; exit 1; }
  trained=$(grep -E '^version [0-9]+: fingerprint ' "$tmp/trainer.out")
  served=$(grep -E '^version [0-9]+: fingerprint ' "$tmp/engine.out")
  if [[ $(wc -l <<<"$trained") -ne 3 || "$trained" != "$served" ]] || ! grep -q '^engine: done at version 3$' "$tmp/engine.out"; then
    echo "README.md: the C++ pair disagrees:"; echo "trainer:"; cat "$tmp/trainer.out"; echo "engine:"; cat "$tmp/engine.out"; exit 1
  fi
  [[ ! -e "$tmp/endpoint" ]] || { echo "README.md: the C++ engine left its endpoint file"; exit 1; }
  echo "README.md: the C++ engine.cpp + trainer.cpp pair refits 3 versions and both sides agree"
fi
