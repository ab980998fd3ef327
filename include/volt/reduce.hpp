#pragma once
/// \file
/// `volt::Reduce`: how values are combined, over an epoch's logged values and across ranks. A word of the ground
/// floor: logging (metric_store.hpp), the collective backends (comm/) and the strategies take it.

namespace volt {

/// How values are combined: over an epoch (a logged value; `mean` is weighted by batch size, as Lightning's
/// default) and across ranks (`mean` there divides the sum by the world size).
enum class Reduce { mean, sum, max, min };

}  // namespace volt
