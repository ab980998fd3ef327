#pragma once
/// \file Precisions: Fp32, Fp64True, Bf16Mixed (Bf16), Fp16Mixed (Fp16), Bf16True (see precision/concept.hpp).
#include "volt/precision/bf16_mixed.hpp"
#include "volt/precision/bf16_true.hpp"
#include "volt/precision/concept.hpp"
#include "volt/precision/fp16_mixed.hpp"
#include "volt/precision/fp32.hpp"
#include "volt/precision/fp64_true.hpp"
#include "volt/precision/grad_scaler.hpp"
