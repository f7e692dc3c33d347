// refit — GPU copy engines (built only with CUDA). See copy.hpp.
#pragma once

#include <memory>

#include "copy/copy.hpp"

namespace refit::copy {

/// kernel, memcpy_batch or memcpy_each on CUDA device `device`.
std::unique_ptr<copier> make_cuda_copier(engine e, int device);

}  // namespace refit::copy
