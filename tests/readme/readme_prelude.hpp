// Placeholders for what a real worker has and the README's C++ fragments only name: its model's
// parameters, its CUDA stream, its engine's loading code. readme_blocks.py --prelude puts this
// file before every `<!-- README-test: fragment -->` block (#included after the block's own).
// Declarations only: the blocks are compiled, never linked or run. Include just the standard
// headers these declarations need, so a block must still include what it uses itself.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

/// One parameter of the worker's model (a torch.nn.Parameter, a Megatron shard, ...).
struct my_parameter {
  std::string name;
  std::vector<std::int64_t> shape;
  void* data;
};
std::vector<my_parameter> my_model_parameters();
/// The generation worker's receiver::endpoint(), however the two workers exchange it.
std::string endpoint_from_generation_worker();
/// The cudaStream_t the policy worker produces its parameters on.
void* my_cuda_stream();
/// The training step, used as the refit's version.
extern std::uint64_t step;
/// Set when the generation worker shuts down.
extern std::atomic<bool> shutting_down;
/// The engine's own loading code (fusing q/k/v, quantising, ...).
void load_into_engine(const std::string& name, std::uint64_t offset, const void* data, std::uint64_t bytes,
                      void* stream);
/// The engine starts generating with the weights of `version`.
void swap_in_new_weights(std::uint64_t version);
