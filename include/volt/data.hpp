#pragma once
/// \file Loaders shipped with volt.
#include "volt/data/tensor_loader.hpp"
