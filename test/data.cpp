// Batches and loaders: the batch helpers, TensorLoader's sizes, shuffles and shards (as DistributedSampler),
// and loader positions saved and resumed, across rank counts too.

#include "common.hpp"

#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>

// ---- batches and loaders --------------------------------------------------------------------------------

TEST_CASE("batch helpers reach every tensor of nested batches", "[unit]") {
  using B = std::tuple<torch::Tensor, std::vector<torch::Tensor>, std::pair<int, torch::Tensor>>;
  B b{torch::ones({3, 2}), {torch::zeros({3}), torch::ones({3}, torch::kLong)}, {7, torch::ones({3, 1})}};
  auto c = volt::batch_to_floating_dtype(b, torch::kFloat64);
  CHECK(std::get<0>(c).scalar_type() == torch::kFloat64);
  CHECK(std::get<1>(c)[0].scalar_type() == torch::kFloat64);
  CHECK(std::get<1>(c)[1].scalar_type() == torch::kLong);  // integer tensors stay
  CHECK(std::get<2>(c).first == 7);
  CHECK(volt::infer_batch_size(b) == 3);
  torch::data::Example<> e{torch::ones({5, 2}), torch::ones({5})};
  CHECK(volt::infer_batch_size(e) == 5);
  CHECK(volt::batch_to_device(e, torch::kCPU).data.sizes() == e.data.sizes());
}

namespace {
struct Opaque {  // no BatchTraits
  torch::Tensor x;
};
}  // namespace

TEST_CASE("MappableBatch: which batch types volt can look inside", "[unit]") {
  STATIC_REQUIRE(volt::MappableBatch<torch::Tensor>);
  STATIC_REQUIRE(volt::MappableBatch<torch::data::Example<>>);
  STATIC_REQUIRE(volt::MappableBatch<std::tuple<torch::Tensor, std::vector<torch::Tensor>, std::pair<int, torch::Tensor>>>);
  STATIC_REQUIRE(volt::MappableBatch<std::map<std::string, std::optional<torch::Tensor>>>);
  STATIC_REQUIRE_FALSE(volt::MappableBatch<Opaque>);
  STATIC_REQUIRE_FALSE(volt::MappableBatch<std::vector<Opaque>>);  // a known container of an unknown type
  STATIC_REQUIRE_FALSE(volt::MappableBatch<std::pair<torch::Tensor, Opaque>>);
  STATIC_REQUIRE_FALSE(volt::MappableBatch<torch::data::Example<Opaque, torch::Tensor>>);
}

TEST_CASE("TensorLoader: sizes, views, per-epoch seeded shuffles", "[unit][data]") {
  auto x = torch::arange(10, torch::kFloat32).unsqueeze(1);
  auto y = torch::arange(10);
  volt::data::TensorLoader plain(x, y, {.batch_size = 4});
  CHECK(plain.size() == 3);
  std::vector<int64_t> seen;
  for (auto b : plain) {
    for (int64_t i = 0; i < b.target.size(0); ++i) seen.push_back(b.target[i].item<int64_t>());
  }
  CHECK(seen == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  volt::data::TensorLoader dropping(x, y, {.batch_size = 4, .drop_last = true});
  CHECK(dropping.size() == 2);

  volt::data::TensorLoader shuffled(x, y, {.batch_size = 3, .shuffle = true, .seed = 5});
  auto epoch_order = [&](int64_t e) {
    shuffled.set_epoch(e);
    std::vector<int64_t> o;
    for (auto b : shuffled)
      for (int64_t i = 0; i < b.target.size(0); ++i) o.push_back(b.target[i].item<int64_t>());
    return o;
  };
  auto e0 = epoch_order(0), e0again = epoch_order(0), e1 = epoch_order(1);
  CHECK(e0 == e0again);
  CHECK(e0 != e1);
  std::sort(e1.begin(), e1.end());
  CHECK(e1 == seen);  // a permutation: every sample once
  // independent of the global generator
  torch::manual_seed(999);
  CHECK(epoch_order(0) == e0);
  CHECK_THROWS_WITH(volt::data::TensorLoader(x, torch::arange(9), {}), Contains("10 samples") && Contains("9 targets"));
  CHECK_THROWS_WITH(volt::data::TensorLoader(x, y, {.batch_size = 0}), Contains("batch_size=0"));
}

TEST_CASE("TensorLoader::shard splits one permutation like DistributedSampler", "[unit][data][dist]") {
  auto x = torch::arange(10, torch::kFloat32).unsqueeze(1);
  volt::data::TensorLoader whole(x, x, {.batch_size = 2, .shuffle = true, .seed = 4});
  whole.set_epoch(3);
  const auto perm = whole.order();
  for (int world : {2, 3, 4}) {
    std::vector<int64_t> seen;
    int64_t batches = -1;
    for (int r = 0; r < world; ++r) {
      auto s = whole.shard(r, world);
      s.set_epoch(3);
      CHECK(s.num_samples() == (10 + world - 1) / world);
      if (batches >= 0) CHECK(s.size() == batches);  // equal batch counts on every rank
      batches = s.size();
      int64_t k = 0;
      for (auto b : s) {
        for (int64_t i = 0; i < b.data.size(0); ++i, ++k) {
          const int64_t idx = b.data[i][0].item<int64_t>();
          // position r + k*world of the padded global order (the order repeats from its start)
          CHECK(idx == perm[(r + k * world) % 10].item<int64_t>());
          seen.push_back(idx);
        }
      }
    }
    std::sort(seen.begin(), seen.end());
    CHECK(std::unique(seen.begin(), seen.end()) - seen.begin() == 10);
  }
  CHECK_THROWS_WITH(whole.shard(2, 2), Contains("rank=2, world_size=2"));
}

// ---- loaders ------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("a loader interrupted after 0, 1 and k batches resumes with the rest of the epoch",
                   "[checkpoint][data]", volt::data::TensorLoader, decltype(index_dataset_loader(1, {}))) {
  auto make = [](int64_t n, volt::data::LoaderOptions o) {
    if constexpr (std::is_same_v<TestType, volt::data::TensorLoader>) {
      return index_loader(n, o);
    } else {
      return index_dataset_loader(n, o);
    }
  };
  for (const bool shuffle : {false, true}) {
    for (const bool drop_last : {false, true}) {
      const volt::data::LoaderOptions o{.batch_size = 3, .shuffle = shuffle, .drop_last = drop_last, .seed = 11};
      for (const int64_t epoch : {0, 2}) {
        auto whole = make(10, o);
        whole.set_epoch(epoch);
        const auto full = take(whole);
        for (int64_t k = 0; k < whole.size(); ++k) {
          INFO("shuffle " << shuffle << " drop_last " << drop_last << " epoch " << epoch << " k " << k);
          auto first = make(10, o);
          first.set_epoch(epoch);
          const auto head = take(first, k);
          const volt::data::LoaderState state = first.state_dict();
          CHECK(state.epoch == epoch);
          CHECK(state.consumed == 3 * k);
          auto second = make(10, o);  // a new loader, as in a new process
          second.load_state_dict(state);
          CHECK(second.batches_done() == k);
          CHECK(cat(head, take(second)) == full);
        }
        // taken after the last batch: the next epoch
        auto done = make(10, o);
        done.set_epoch(epoch);
        take(done);
        const auto end_state = done.state_dict();
        CHECK(end_state.consumed == 10);
        auto next = make(10, o);
        next.load_state_dict(end_state);
        auto reference = make(10, o);
        reference.set_epoch(epoch + 1);
        CHECK(take(next) == take(reference));
        CHECK(next.epoch() == epoch + 1);
      }
    }
  }
}

TEST_CASE("a multi-epoch run resumed mid-epoch continues its per-epoch permutations", "[checkpoint][data]") {
  const volt::data::LoaderOptions o{.batch_size = 4, .shuffle = true, .seed = 3};
  auto ref = index_loader(22, o);
  std::vector<int64_t> expected;
  for (int64_t e = 0; e < 3; ++e) {
    ref.set_epoch(e);
    expected = cat(expected, take(ref));
  }
  // The Trainer's calls: set_epoch before each epoch, a state mid-epoch 1, a new loader, the same calls.
  auto a = index_loader(22, o);
  a.set_epoch(0);
  auto seen = take(a);
  a.set_epoch(1);
  seen = cat(seen, take(a, 2));
  const auto state = a.state_dict();
  auto b = index_loader(22, o);
  b.load_state_dict(state);
  b.set_epoch(1);  // the loaded epoch: the position stays
  seen = cat(seen, take(b));
  b.set_epoch(2);
  seen = cat(seen, take(b));
  CHECK(seen == expected);
  // Iterating a const loader reads the same batches and records nothing.
  auto c = index_loader(22, o);
  c.load_state_dict(state);
  const auto& cc = c;
  std::vector<int64_t> peek;
  for (const auto& batch : cc) peek.push_back(batch.target[0].item<int64_t>());
  CHECK(c.state_dict() == state);
  CHECK(peek.size() == static_cast<std::size_t>(c.size() - 2));
}

TEST_CASE("a loader state that does not fit is refused, naming each difference", "[checkpoint][data]") {
  auto a = index_loader(10, {.batch_size = 3, .shuffle = true, .seed = 11});
  a.set_epoch(1);
  take(a, 2);
  const auto state = a.state_dict();
  auto other_size = index_loader(12, {.batch_size = 3, .shuffle = true, .seed = 11});
  CHECK_THROWS_WITH(other_size.load_state_dict(state), Contains("dataset size 10 in the state vs 12 here"));
  auto other_batch = index_loader(10, {.batch_size = 4, .shuffle = true, .seed = 11});
  CHECK_THROWS_WITH(other_batch.load_state_dict(state), Contains("batch_size 3 in the state vs 4 here"));
  auto other_seed = index_loader(10, {.batch_size = 3, .shuffle = true, .seed = 12});
  CHECK_THROWS_WITH(other_seed.load_state_dict(state), Contains("seed 11 in the state vs 12 here"));
  auto all = index_loader(9, {.batch_size = 2, .shuffle = false, .seed = 1});
  CHECK_THROWS_WITH(all.load_state_dict(state), Contains("dataset size") && Contains("batch_size") &&
                                                    Contains("seed") && Contains("shuffle"));
  // a refused state changes nothing
  all.set_epoch(0);
  CHECK(take(all) == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8});
  auto bad = state;
  bad.consumed = 11;
  CHECK_THROWS_WITH(index_loader(10, {.batch_size = 3, .shuffle = true, .seed = 11}).load_state_dict(bad),
                    Contains("consumed=11"));
}

TEST_CASE("a state saved on N ranks resumes on M ranks: every remaining sample once", "[checkpoint][data]") {
  const volt::data::LoaderOptions o{.batch_size = 2, .shuffle = true, .seed = 9};
  for (const auto& [n, saved_on, resumed_on, k] : std::vector<std::tuple<int64_t, int, int, int64_t>>{
           {24, 2, 1, 3}, {24, 2, 3, 3}, {24, 1, 2, 5}, {24, 4, 2, 1}, {30, 3, 2, 2}}) {
    INFO("n " << n << " saved on " << saved_on << " resumed on " << resumed_on << " after " << k << " batches");
    auto whole = index_loader(n, o);
    whole.set_epoch(1);
    std::multiset<int64_t> seen;
    std::optional<volt::data::LoaderState> state;
    for (int r = 0; r < saved_on; ++r) {
      auto shard = whole.shard(r, saved_on);
      for (int64_t i : take(shard, k)) seen.insert(i);
      if (state) CHECK(shard.state_dict().consumed == state->consumed);  // every rank agrees
      state = shard.state_dict();
    }
    CHECK(state->consumed == k * o.batch_size * saved_on);
    for (int r = 0; r < resumed_on; ++r) {
      auto shard = index_loader(n, o).shard(r, resumed_on);
      shard.load_state_dict(*state);
      for (int64_t i : take(shard)) seen.insert(i);
    }
    for (int64_t i = 0; i < n; ++i) CHECK(seen.count(i) == 1);
    CHECK(static_cast<int64_t>(seen.size()) == n);
  }
  SECTION("the same number of ranks reproduces every rank's batches, padding included") {
    const volt::data::LoaderOptions p{.batch_size = 4, .shuffle = true, .seed = 2};
    for (int r = 0; r < 2; ++r) {
      auto ref = index_loader(47, p).shard(r, 2);
      ref.set_epoch(3);
      const auto full = take(ref);
      auto first = index_loader(47, p).shard(r, 2);
      first.set_epoch(3);
      const auto head = take(first, 2);
      auto second = index_loader(47, p).shard(r, 2);
      second.load_state_dict(first.state_dict());
      CHECK(cat(head, take(second)) == full);
    }
  }
}
