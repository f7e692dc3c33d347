// refit — which symbols librefit.so exports.
//
// librefit is built with hidden symbol visibility (gnu_symbol_visibility in meson.build): the
// layers under lib/ (wire, channel, transport, copy, ...) and the msgpack, fmt and cppzmq code
// they instantiate stay inside the library, so they cannot be bound to by users, cannot collide
// with a user's own copies of those libraries, and can change without changing refit's ABI.
// REFIT_API marks what stays visible: every function these headers declare and lib/ defines, and
// every class with a member function, vtable or typeinfo that the library emits (the plain option
// and stats structs have none, so they need no mark). On a class it covers the member functions,
// the vtable and the typeinfo, so that a refit::error thrown inside librefit.so is caught as one
// by the user's code, and a user's tensor_source is the type the library calls.
//
// tests/consumer/check_exports.sh (unit suite) fails when librefit.so exports anything else.
// This is the one macro of the public headers that is not about logging.
#pragma once

#if defined(__GNUC__) || defined(__clang__)
#define REFIT_API __attribute__((visibility("default")))
#else
#define REFIT_API
#endif
