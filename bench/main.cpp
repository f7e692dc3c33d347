// refit-bench: see bench/bench.hpp and `refit-bench --help`.
#include "bench/bench.hpp"

int main(int argc, char** argv) { return refit::bench::bench_main(argc, argv); }
