// Precompiled header for the two translation units that use libtorch.
#pragma once
#include <torch/torch.h>
