#pragma once
/// \file Loaders shipped with volt: stateful, shardable, resumable, with background workers (see data/stateful.hpp).
#include "volt/data/dataset_loader.hpp"
#include "volt/data/fetch.hpp"
#include "volt/data/loaders.hpp"
#include "volt/data/sample_loader.hpp"
#include "volt/data/stateful.hpp"
#include "volt/data/tensor_loader.hpp"
#include "volt/data/token_file.hpp"
