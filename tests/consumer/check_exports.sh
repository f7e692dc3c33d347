#!/usr/bin/env bash
# check_exports.sh LIBREFIT_SO INCLUDE_DIR — fails when librefit.so exports a symbol that is not
# refit's public API (registered by tests/meson.build in the unit suite).
#
# The API is what INCLUDE_DIR/refit/*.hpp marks REFIT_API (include/refit/export.hpp): a symbol
# passes when its demangled name is
#   - refit::f(...)                  f declared REFIT_API in a header (a free function),
#   - refit::C::m(...)               C a class declared REFIT_API (its own members, not those of a
#                                    class nested in it: receiver::impl is no API),
#   - typeinfo / typeinfo name / vtable for refit::C, C such a class,
#   - one of the linker's own symbols (_init, _fini, _edata, _end, __bss_start).
# Everything else fails: the layers' namespaces (refit::wire::, refit::copy::, refit::transport::,
# refit::channel::, refit::log::, refit::plan::detail), anything local to a function (lambdas),
# templates, and every C++ symbol outside refit — msgpack, fmt, cppzmq, and libstdc++ templates
# instantiated with public types, which lib/librefit.map keeps local.
# Exit 77 (SKIP) when nm is missing or LIBREFIT_SO is not a shared library.
set -euo pipefail

lib=${1:?usage: check_exports.sh LIBREFIT_SO INCLUDE_DIR}
inc=${2:?usage: check_exports.sh LIBREFIT_SO INCLUDE_DIR}

if ! command -v nm >/dev/null 2>&1; then
  echo "check_exports.sh: SKIP: nm not found (binutils)"
  exit 77
fi
[[ -f "$lib" ]] || { echo "check_exports.sh: FAIL: $lib does not exist" >&2; exit 1; }

# Names the headers mark REFIT_API: classes (class/struct REFIT_API name) and functions (the
# identifier before the first '(' of a line that carries REFIT_API outside a class head).
headers=("$inc"/refit/*.hpp)
classes=" $(sed -nE 's/.*(class|struct) REFIT_API ([A-Za-z_][A-Za-z0-9_]*).*/\2/p' "${headers[@]}" |
  sort -u | tr '\n' ' ')"
functions=" $(grep -hE 'REFIT_API' "${headers[@]}" | grep -vE '^ *(//|#)|(class|struct) REFIT_API' |
  sed -nE 's/^[^(]*[^A-Za-z0-9_]([A-Za-z_][A-Za-z0-9_]*)\(.*/\1/p' | sort -u | tr '\n' ' ')"
if [[ "$classes" != *" receiver "* || "$functions" != *" version "* ]]; then
  echo "check_exports.sh: FAIL: found no REFIT_API marks in $inc/refit/*.hpp" >&2
  exit 1
fi

# "0000000000012340 T refit::version()" -> "refit::version()"; nm -C demangles.
symbols=$(nm -D --defined-only -C "$lib" 2>/dev/null) ||
  { echo "check_exports.sh: SKIP: nm -D cannot read $lib (not a shared library?)"; exit 77; }

# Why a demangled symbol is not API; empty when it is.
why_not_api() {
  local s=$1 entity head rest
  case $s in
    _init | _fini | _edata | _end | __bss_start) return ;;
  esac
  entity=$s
  local data=0
  for p in 'typeinfo name for ' 'typeinfo for ' 'vtable for ' 'VTT for '; do
    if [[ $entity == "$p"* ]]; then entity=${entity#"$p"}; data=1; break; fi
  done
  [[ $entity == refit::* ]] || { echo "outside namespace refit"; return; }
  [[ $entity == *")::"* ]] && { echo "local to a function"; return; }
  head=${entity%%(*}
  head=${head//\[abi:cxx11\]/}
  [[ $head == *"<"* ]] && { echo "a template"; return; }
  rest=${head#refit::}
  if [[ $data -eq 1 ]]; then
    [[ $classes == *" $rest "* ]] || echo "typeinfo or vtable of a class that is not REFIT_API"
    return
  fi
  local outer=${rest%%::*}
  if [[ $rest != *::* ]]; then
    [[ $functions == *" $rest "* ]] || echo "refit::$rest is not declared REFIT_API"
  elif [[ $classes != *" $outer "* ]]; then
    echo "refit::$outer is an internal namespace or class"
  elif [[ $rest == *::*::* ]]; then
    echo "a class nested in refit::$outer"
  fi
}

total=0 bad=0
while read -r _ _ name; do
  [[ -n "$name" ]] || continue
  total=$((total + 1))
  reason=$(why_not_api "$name")
  if [[ -n "$reason" ]]; then
    bad=$((bad + 1))
    printf 'not API (%s): %s\n' "$reason" "$name"
  fi
done <<<"$symbols"

echo "check_exports.sh: $lib exports $total symbols, $bad outside the API"
if [[ $bad -gt 0 ]]; then
  echo "check_exports.sh: FAIL: mark what is API REFIT_API (include/refit/export.hpp); what is not" \
       "must stay hidden" >&2
  exit 1
fi
[[ $total -gt 0 ]] || { echo "check_exports.sh: FAIL: $lib exports nothing" >&2; exit 1; }
echo "check_exports.sh: ok"
