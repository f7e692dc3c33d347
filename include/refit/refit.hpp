// refit — umbrella header.
#pragma once

#include "refit/error.hpp"
#include "refit/memory.hpp"
#include "refit/model.hpp"
#include "refit/nccl.hpp"
#include "refit/options.hpp"
#include "refit/plan.hpp"
#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
#include "refit/version.hpp"
