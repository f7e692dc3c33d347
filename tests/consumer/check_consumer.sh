#!/usr/bin/env bash
# check_consumer.sh pkg-config|source-tree — builds tests/consumer/consumer.cpp the way a user of
# refit does and runs it (registered by tests/meson.build in the unit suite).
#
#   pkg-config   `meson install --destdir` into a scratch directory (runtime and devel files, as a
#                package would hold them), then compile and link with nothing but
#                `pkg-config --cflags --libs refit` where the only .pc on the search path is the
#                installed refit.pc (PKG_CONFIG_LIBDIR: libzmq.pc, fmt.pc, ... are not found),
#                prefix redefined to the scratch directory. Checks that --cflags and --libs name
#                nothing but refit's own directories and -lrefit. When REFIT_STATIC_ARCHIVE is
#                set (an archive of librefit's objects), also links librefit.a alone with
#                `pkg-config --static --libs refit`: Libs.private must be enough.
#   source-tree  compile with only -I <source>/include (the public headers must not need a
#                generated file) and link the librefit.so of the build directory.
#
# Environment (set by tests/meson.build): REFIT_SOURCE_ROOT, REFIT_BUILD_ROOT, CXX (the project's
# compiler command, words split), MESON, PKG_CONFIG, REFIT_SANITIZE (b_sanitize),
# REFIT_STATIC_ARCHIVE (optional). Exit 77 (SKIP) in sanitizer builds: an instrumented librefit
# needs the consumer built with the same sanitizer runtime, which says nothing about packaging.
set -euo pipefail

mode=${1:?usage: check_consumer.sh pkg-config|source-tree}
src=${REFIT_SOURCE_ROOT:?} build=${REFIT_BUILD_ROOT:?}
read -r -a cxx <<<"${CXX:?}"
consumer="$src/tests/consumer/consumer.cpp"
# The flags the consumer itself needs (it starts a thread); everything about refit comes from
# pkg-config or the one -I.
cxxflags=(-std=c++20 -Wall -Wextra -Wpedantic -Werror -pthread)

fail() { printf 'check_consumer.sh: FAIL: %s\n' "$*" >&2; exit 1; }
run() { printf '+ %s\n' "$*"; "$@"; }

if [[ "${REFIT_SANITIZE:-none}" != none ]]; then
  echo "check_consumer.sh: SKIP in a b_sanitize=$REFIT_SANITIZE build"
  exit 77
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/refit-consumer.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

case $mode in
  source-tree)
    run "${cxx[@]}" "${cxxflags[@]}" -I "$src/include" "$consumer" -o "$tmp/consumer" \
      -L "$build" -lrefit -Wl,-rpath,"$build"
    run "$tmp/consumer"
    ;;

  pkg-config)
    run "${MESON:?}" install -C "$build" --destdir "$tmp/dest" --no-rebuild --tags runtime,devel \
      >"$tmp/install.log" || { cat "$tmp/install.log"; fail "meson install failed"; }
    pc=$(find "$tmp/dest" -name refit.pc -path '*/pkgconfig/*')
    [[ -n "$pc" ]] || fail "meson install put no pkgconfig/refit.pc under the destdir"
    # Only refit.pc is visible: PKG_CONFIG_LIBDIR replaces the system search path.
    export PKG_CONFIG_LIBDIR
    PKG_CONFIG_LIBDIR=$(dirname "$pc")
    unset PKG_CONFIG_PATH PKG_CONFIG_SYSROOT_DIR
    prefix=$("${PKG_CONFIG:?}" --variable=prefix refit)
    root="$tmp/dest$prefix"
    pkgconf() { "$PKG_CONFIG" --define-variable=prefix="$root" "$@"; }
    printf 'refit.pc (%s):\n' "${pc#"$tmp/dest"}"
    sed 's/^/  /' "$pc"

    cflags=$(pkgconf --cflags refit) || fail "pkg-config --cflags refit fails with only refit.pc on the path"
    libs=$(pkgconf --libs refit) || fail "pkg-config --libs refit fails with only refit.pc on the path"
    static_libs=$(pkgconf --static --libs refit) ||
      fail "pkg-config --static --libs refit fails with only refit.pc on the path"
    printf 'cflags: %s\nlibs: %s\nstatic libs: %s\n' "$cflags" "$libs" "$static_libs"
    for f in $cflags; do
      [[ $f == "-I$root/"* ]] || fail "--cflags has '$f': the public headers need only refit's include directory"
    done
    for f in $libs; do
      [[ $f == "-L$root/"* || $f == -lrefit ]] ||
        fail "--libs has '$f': a dynamic link needs only -L\${libdir} -lrefit (librefit.so names its own dependencies)"
    done

    # Dynamic: librefit.so from the scratch prefix.
    # shellcheck disable=SC2086  # pkg-config output is a list of words
    run "${cxx[@]}" "${cxxflags[@]}" "$consumer" -o "$tmp/consumer_dynamic" $cflags $libs
    run env LD_LIBRARY_PATH="$(pkgconf --variable=libdir refit)" "$tmp/consumer_dynamic"

    # Static: the same prefix with librefit.a instead of librefit.so.
    if [[ -n "${REFIT_STATIC_ARCHIVE:-}" ]]; then
      cp -a "$root" "$tmp/static"
      root="$tmp/static"
      libdir=$(pkgconf --variable=libdir refit)
      rm -f "$libdir"/librefit.so*
      # Meson's uninstalled archives are thin (they name the objects): copy the objects in.
      members=()
      mapfile -t members < <(cd "$(dirname "$REFIT_STATIC_ARCHIVE")" && ar t "$REFIT_STATIC_ARCHIVE" |
        while read -r m; do realpath "$m"; done)
      [[ ${#members[@]} -gt 0 ]] || fail "$REFIT_STATIC_ARCHIVE holds no objects"
      ar rcs "$libdir/librefit.a" "${members[@]}"
      # shellcheck disable=SC2086
      run "${cxx[@]}" "${cxxflags[@]}" "$consumer" -o "$tmp/consumer_static" \
        $(pkgconf --cflags refit) $(pkgconf --static --libs refit)
      if readelf -d "$tmp/consumer_static" | grep -q 'NEEDED.*librefit'; then
        fail "the static consumer still needs librefit.so"
      fi
      run "$tmp/consumer_static"
    fi
    ;;

  *) fail "unknown mode '$mode' (pkg-config or source-tree)" ;;
esac
echo "check_consumer.sh $mode: ok"
