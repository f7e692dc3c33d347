#!/usr/bin/env bash
# check_readme_cpp.sh — compiles every ```cpp block of README.md (unit suite, tests/meson.build).
#
# tests/readme/readme_blocks.py writes each block (with the blocks that continue it) as one
# translation unit; the README says how with an HTML comment before a block:
#   <!-- README-test: fragment -->    statements: wrapped in a function, after the placeholders of
#                                      tests/readme/readme_prelude.hpp (declare new ones there)
#   <!-- README-test: continues -->   goes on from the previous C++ block (same function body)
#   (none)                             a whole translation unit
# Each is compiled as a user would, with the project's compiler against the public headers of
# the source tree only: -std=c++20 -Wall -Wextra -Wpedantic -Werror -I include. Diagnostics name
# README.md lines (#line). Fails when any block fails, or when none was found.
#
# Environment (set by tests/meson.build): REFIT_SOURCE_ROOT, CXX (words split), PYTHON.
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
exit $failed
