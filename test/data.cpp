// Batches and loaders: the batch helpers, TensorLoader's sizes, shuffles and shards (as DistributedSampler),
// loader positions saved and resumed, across rank counts too, and workers: the same batches for any worker count,
// augmentation seeded per sample, a failing read, stopping.

#include "common.hpp"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <thread>

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
     for (const int workers : {0, 3}) {  // the position counts delivered batches, not those fetched ahead
      const volt::data::LoaderOptions o{.batch_size = 3, .shuffle = shuffle, .drop_last = drop_last, .seed = 11,
                                        .num_workers = workers, .prefetch_factor = 2};
      for (const int64_t epoch : {0, 2}) {
        auto whole = make(10, o);
        whole.set_epoch(epoch);
        const auto full = take(whole);
        for (int64_t k = 0; k < whole.size(); ++k) {
          INFO("shuffle " << shuffle << " drop_last " << drop_last << " epoch " << epoch << " k " << k << " workers "
               << workers);
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

// ---- workers ----------------------------------------------------------------------------------------------

namespace {

/// Every batch of an epoch, as tensors (data and target), for bitwise comparison.
template <class L>
std::vector<torch::data::Example<>> epoch_batches(L& loader, int64_t epoch) {
  loader.set_epoch(epoch);
  std::vector<torch::data::Example<>> out;
  for (auto it = loader.begin(); it != loader.end(); ++it) out.push_back(*it);
  return out;
}

bool same_batches(const std::vector<torch::data::Example<>>& a, const std::vector<torch::data::Example<>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i].data, b[i].data) || !torch::equal(a[i].target, b[i].target)) return false;
  }
  return true;
}

/// Images 3x4x4 whose sample i is augmented with a random horizontal flip and noise drawn from the generator
/// volt hands `get`; every `slow_every`-th read sleeps `sleep`, and index `bad` throws.
struct AugmentedImages {
  torch::Tensor x = torch::arange(61 * 48, torch::kFloat32).reshape({61, 3, 4, 4});
  int64_t bad = -1;
  std::chrono::milliseconds sleep{0};
  int64_t size() const { return x.size(0); }
  torch::data::Example<> get(int64_t i, at::Generator& gen) const {
    if (i == bad) throw std::runtime_error("cannot decode sample " + std::to_string(i));
    if (sleep.count() > 0) std::this_thread::sleep_for(sleep);
    torch::Tensor img = x[i];
    if (torch::rand({1}, gen).item<float>() < 0.5f) img = img.flip({2});
    return {img + 0.01 * torch::randn(img.sizes(), gen), torch::full({1}, i, torch::kLong)};
  }
};

}  // namespace

TEST_CASE("workers deliver the synchronous loader's batches, bitwise, on 1 and 2 ranks", "[loader][data]") {
  for (const int world : {1, 2}) {
    for (const bool shuffle : {false, true}) {
      const volt::data::LoaderOptions sync{.batch_size = 4, .shuffle = shuffle, .seed = 5};
      for (int rank = 0; rank < world; ++rank) {
        auto reference = volt::data::SampleLoader(AugmentedImages{}, sync).shard(rank, world);
        for (const int workers : {1, 3}) {
          for (const int prefetch : {1, 2}) {
            INFO("world " << world << " rank " << rank << " shuffle " << shuffle << " workers " << workers
                          << " prefetch " << prefetch);
            auto o = sync;
            o.num_workers = workers;
            o.prefetch_factor = prefetch;
            auto loader = volt::data::SampleLoader(AugmentedImages{}, o).shard(rank, world);
            for (const int64_t epoch : {0, 1}) CHECK(same_batches(epoch_batches(loader, epoch), epoch_batches(reference, epoch)));
            auto tensors = index_loader(37, o).shard(rank, world);
            auto tensors_sync = index_loader(37, sync).shard(rank, world);
            CHECK(same_batches(epoch_batches(tensors, 1), epoch_batches(tensors_sync, 1)));
          }
        }
      }
    }
  }
}

TEST_CASE("an iterator with workers may skip batches unread, as a resume without a position does", "[loader][data]") {
  const volt::data::LoaderOptions sync{.batch_size = 4, .shuffle = true, .seed = 5};
  auto reference = volt::data::SampleLoader(AugmentedImages{}, sync);
  const auto all = epoch_batches(reference, 0);
  auto o = sync;
  o.num_workers = 3;
  volt::data::SampleLoader loader(AugmentedImages{}, o);
  auto it = loader.begin();
  for (int i = 0; i < 7; ++i) ++it;  // more than the batches in flight (3 x 2)
  std::vector<torch::data::Example<>> rest;
  for (; it != loader.end(); ++it) rest.push_back(*it);
  CHECK(same_batches(rest, std::vector<torch::data::Example<>>(all.begin() + 7, all.end())));
}

TEST_CASE("an evaluation shard deals every batch of one order, pass after pass", "[loader][data]") {
  const volt::data::LoaderOptions o{.batch_size = 4, .shuffle = true, .seed = 5};
  auto whole = volt::data::SampleLoader(AugmentedImages{}, o);
  const auto all = epoch_batches(whole, 0);  // 16 batches, the last of 1 sample
  for (const int world : {2, 3}) {
    for (int rank = 0; rank < world; ++rank) {
      auto shard = whole.shard(rank, world, volt::data::Split::whole_batches);
      for (int pass = 0; pass < 2; ++pass) {  // a partial pass (the sanity check's) first, then whole ones
        std::vector<torch::data::Example<>> got;
        for (auto it = shard.begin(); it != shard.end(); ++it) {
          got.push_back(*it);
          if (pass == 0 && got.size() == 5) break;
        }
        std::vector<torch::data::Example<>> want;
        for (std::size_t k = static_cast<std::size_t>(rank); k < all.size(); k += static_cast<std::size_t>(world)) {
          if (pass == 0 && want.size() == 5) break;
          want.push_back(all[k]);
        }
        INFO("world " << world << " rank " << rank << " pass " << pass);
        CHECK(same_batches(got, want));
        CHECK(shard.size() == static_cast<int64_t>((all.size() - rank + world - 1) / world));
      }
    }
  }
}

TEST_CASE("augmentation draws from a generator seeded by (seed, epoch, sample): equal for any worker count and "
          "after a resume", "[loader][data]") {
  const AugmentedImages images;
  const volt::data::LoaderOptions o{.batch_size = 5, .shuffle = true, .seed = 9};
  // The reference, written by hand: each sample with its own generator, in the epoch's permutation.
  auto expected_sample = [&](int64_t epoch, int64_t i) {
    at::Generator gen = volt::data::sample_generator(9, epoch, i);
    return images.get(i, gen).data;
  };
  for (const int workers : {0, 1, 3}) {
    auto opts = o;
    opts.num_workers = workers;
    volt::data::SampleLoader loader(AugmentedImages{}, opts);
    for (const int64_t epoch : {0, 3}) {
      const auto order = [&] {
        loader.set_epoch(epoch);
        return loader.order();
      }();
      const auto batches = epoch_batches(loader, epoch);
      int64_t pos = 0;
      for (const auto& b : batches) {
        for (int64_t j = 0; j < b.data.size(0); ++j, ++pos) {
          const int64_t i = order[pos].item<int64_t>();
          REQUIRE(b.target[j].item<int64_t>() == i);
          CHECK(torch::equal(b.data[j], expected_sample(epoch, i)));
        }
      }
      CHECK(pos == 61);
    }
    // Not the same noise in another epoch (the epoch is part of the seed).
    CHECK_FALSE(torch::equal(expected_sample(0, 7), expected_sample(1, 7)));
    // Interrupted after 4 batches with 3 workers fetching ahead, resumed by a loader with `workers` workers.
    auto ahead = o;
    ahead.num_workers = 3;
    volt::data::SampleLoader first(AugmentedImages{}, ahead);
    first.set_epoch(2);
    std::vector<torch::data::Example<>> head;
    {
      auto it = first.begin();
      for (int k = 0; k < 4; ++k, ++it) head.push_back(*it);
    }
    volt::data::SampleLoader second(AugmentedImages{}, opts);
    second.load_state_dict(first.state_dict());
    second.set_epoch(2);
    auto rest = epoch_batches(second, 2);
    head.insert(head.end(), rest.begin(), rest.end());
    volt::data::SampleLoader whole(AugmentedImages{}, o);
    CHECK(same_batches(head, epoch_batches(whole, 2)));
  }
}

TEST_CASE("a sample that fails to read ends the pass at its batch with a LoaderError naming it", "[loader][data]") {
  for (const int workers : {0, 3}) {
    INFO("workers " << workers);
    AugmentedImages images;
    images.bad = 22;  // batch 5 of 4 samples, without shuffling
    volt::data::SampleLoader loader(images, {.batch_size = 4, .num_workers = workers});
    int64_t delivered = 0;
    try {
      for (auto it = loader.begin(); it != loader.end(); ++it, ++delivered) (void)*it;
      FAIL("no error");
    } catch (const volt::LoaderError& e) {
      CHECK_THAT(e.what(), Contains("reading batch 5 of epoch 0 (samples 20, 21, 22, 23)") &&
                               Contains("cannot decode sample 22"));
      if (workers > 0) CHECK_THAT(e.what(), Contains("on loader worker"));
      CHECK_THROWS_WITH(std::rethrow_if_nested(e), Contains("cannot decode sample 22"));
    }
    CHECK(delivered == 5);  // the batches before it were delivered
    CHECK(loader.state_dict().consumed == 20);
  }
}

namespace {
struct ImageNetImpl : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  ImageNetImpl() { lin = register_module("lin", torch::nn::Linear(48, 1)); }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) {
    return lin(b.data.flatten(1)).pow(2).mean();
  }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), torch::optim::SGDOptions(1e-4)); }
};
TORCH_MODULE(ImageNet);
}  // namespace

TEST_CASE("a worker's failed read ends the fit with its message; the checkpoint before it is kept", "[loader][data]") {
  const std::string dir = scratch("loader_failure").string();
  AugmentedImages images;
  images.bad = 45;  // epoch 1 (61 samples, batches of 4, shuffled): some batch of it
  volt::data::SampleLoader loader(images, {.batch_size = 4, .shuffle = true, .seed = 2, .num_workers = 3});
  ImageNet net;
  auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>(
      {.max_epochs = 2, .default_root_dir = dir}, volt::ModelCheckpoint({.dirpath = dir + "/ckpt", .save_top_k = 0, .save_last = true, .every_n_train_steps = 1}));
  CHECK_THROWS_WITH(trainer.fit(net, loader), Contains("of epoch 0") && Contains("on loader worker") &&
                                                   Contains("cannot decode sample 45"));
  // The last checkpoint is the step before the failing batch, whole.
  const int64_t step = volt::checkpoint::read(dir + "/ckpt/last.ckpt").at("loops").toGenericDict().at("global_step").toInt();
  CHECK(step == trainer.global_step());
  CHECK(step < 16);
}

TEST_CASE("a pass with workers stops within one sample's read when it ends early", "[loader][data]") {
  AugmentedImages images;
  images.sleep = std::chrono::milliseconds(300);  // 8 samples a batch: 2.4 s to read a whole batch
  volt::data::SampleLoader loader(images, {.batch_size = 8, .num_workers = 3, .prefetch_factor = 2});
  auto it = std::make_unique<decltype(loader.begin())>(loader.begin());
  (void)**it;  // the first batch; the workers are now inside the next ones
  const auto t0 = std::chrono::steady_clock::now();
  it.reset();  // joins the workers
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO("joined in " << seconds << " s");
  CHECK(seconds < 1.5);  // one sample (0.3 s) per worker, not a batch (2.4 s)
}

TEST_CASE("a data set that draws nothing gets no seeded generator", "[loader][data]") {
  struct Plain {
    bool draws = false;
    int64_t size() const { return 6; }
    bool draws_random() const { return draws; }
    torch::Tensor get(int64_t i, at::Generator& gen) const {
      return torch::tensor({static_cast<double>(i), gen.defined() ? 1.0 : 0.0});
    }
  };
  for (const bool draws : {false, true}) {
    volt::data::SampleLoader loader(Plain{draws}, {.batch_size = 3, .num_workers = 2});
    for (auto&& b : loader) CHECK(torch::equal(b.select(1, 1).to(torch::kDouble), torch::full({3}, draws ? 1.0 : 0.0, torch::kDouble)));
  }
}

TEST_CASE("worker threads run LibTorch's operations on one thread", "[loader][data]") {
  struct Threads {
    int64_t size() const { return 4; }
    torch::Tensor get(int64_t) const {
      (void)torch::ones({1 << 16}).sum();  // a kernel first: LibTorch sets a new thread up at its first one
      return torch::tensor({static_cast<int64_t>(at::get_num_threads())});
    }
  };
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  volt::data::SampleLoader loader(Threads{}, {.batch_size = 2, .num_workers = 2});
  std::vector<int64_t> seen;
  for (auto&& b : loader) seen.insert(seen.end(), b.data_ptr<int64_t>(), b.data_ptr<int64_t>() + b.numel());
  const int after = at::get_num_threads();
  at::set_num_threads(before);
  CHECK(seen == std::vector<int64_t>{1, 1, 1, 1});
  CHECK(after == 2);  // the training thread keeps its own
}

TEST_CASE("loader options are checked", "[loader][data]") {
  CHECK_THROWS_WITH(index_loader(4, {.num_workers = -1}), Contains("num_workers=-1 is not allowed: give a number >= 0"));
  CHECK_THROWS_WITH(index_loader(4, {.prefetch_factor = 0}), Contains("prefetch_factor=0 is not allowed"));
  vt::CaptureCerr cerr;
  auto pinned = index_loader(4, {.batch_size = 2, .pin_memory = true});
  CHECK(take(pinned) == std::vector<int64_t>{0, 1, 2, 3});
  if (!torch::cuda::is_available()) CHECK_THAT(cerr.str(), Contains("pin_memory=true, but LibTorch sees no CUDA device"));
}

namespace {
/// Sends SIGTERM to this process `after` the end of training batch `batch`, from another thread, once.
struct TermAfterBatch {
  int64_t batch;
  std::chrono::milliseconds after;
  std::shared_ptr<std::thread> sender;
  std::shared_ptr<std::chrono::steady_clock::time_point> sent = std::make_shared<std::chrono::steady_clock::time_point>();
  template <class T, class M, class B>
  void on_train_batch_end(T&, M&, const torch::Tensor&, const B&, int64_t idx) {
    if (idx != batch || sender) return;
    sender = std::make_shared<std::thread>([after = after, sent = sent] {
      std::this_thread::sleep_for(after);
      *sent = std::chrono::steady_clock::now();
      ::kill(::getpid(), SIGTERM);
    });
  }
};
}  // namespace

TEST_CASE("SIGTERM while the workers read slowly: the fit saves and stops after the batch it waits for",
          "[loader][data]") {
  const std::string dir = scratch("loader_sigterm").string();
  AugmentedImages images;
  images.sleep = std::chrono::milliseconds(100);  // 0.4 s a batch of 4; the epoch's 15 batches take ~2 s on 3 workers
  volt::data::SampleLoader loader(images, {.batch_size = 4, .num_workers = 3, .prefetch_factor = 2});
  ImageNet net;
  TermAfterBatch term{1, std::chrono::milliseconds(50), {}};
  auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>(
      {.max_epochs = 3, .default_root_dir = dir, .signals = {.exit_process = false}},
      term);
  std::chrono::steady_clock::time_point stopped;
  try {
    trainer.fit(net, loader);
    FAIL("the fit was not interrupted");
  } catch (const volt::Interrupted& e) {
    stopped = std::chrono::steady_clock::now();
    CHECK(e.signal() == SIGTERM);
    REQUIRE(fs::exists(e.checkpoint()));
    // The batch being read when the signal came was trained, then the fit stopped.
    const int64_t step = volt::checkpoint::read(e.checkpoint()).at("loops").toGenericDict().at("global_step").toInt();
    CHECK(step >= 3);
    CHECK(step < 16);
  }
  auto& sender = std::get<TermAfterBatch>(trainer.callbacks()).sender;
  REQUIRE(sender);
  sender->join();
  const double seconds = std::chrono::duration<double>(stopped - *std::get<TermAfterBatch>(trainer.callbacks()).sent).count();
  INFO("stopped " << seconds << " s after the signal");
  // The bound: the rest of the batch in flight (at most 0.4 s), a step, the checkpoint, and joining the workers
  // (one 0.1 s sample each); the rest of the run would take about 5 s.
  CHECK(seconds < 1.5);
}

// ---- token files ------------------------------------------------------------------------------------------

namespace {
/// Writes `bytes` to `path`.
fs::path write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}
/// A `.npy` file of format 1 with this header dictionary and these data bytes, padded as NumPy pads.
std::string npy(const std::string& dict, const std::string& data) {
  std::string header = dict;
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>(header.size() >> 8);
  return out + header + data;
}
/// The resident memory of this process, in bytes (/proc/self/statm).
int64_t resident_bytes() {
  long long pages = 0, resident = 0;
  std::ifstream("/proc/self/statm") >> pages >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}
/// Every window of one pass as int64 ids, x then y, row by row.
void write_windows(volt::data::TokenLoader& loader, std::ofstream& out) {
  for (const auto& b : loader) {
    for (int64_t r = 0; r < b.data.size(0); ++r) {
      out.write(reinterpret_cast<const char*>(b.data[r].data_ptr<int64_t>()), b.data.size(1) * 8);
      out.write(reinterpret_cast<const char*>(b.target[r].data_ptr<int64_t>()), b.target.size(1) * 8);
    }
  }
}
}  // namespace

TEST_CASE("token files: windows as nanoGPT cuts them, a position that resumes exactly, disjoint ranks",
          "[loader][data]") {
  const fs::path dir = vt::scratch("tokens");
  std::vector<uint16_t> ids(1000);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<uint16_t>((i * 7919) % 65521);
  const fs::path bin = write_bytes(dir / "train.bin", std::string(reinterpret_cast<const char*>(ids.data()), 2000));
  using volt::data::TokenLoader;
  using volt::data::Windows;
  const volt::data::TokenFile file(bin);
  REQUIRE(file.size() == 1000);
  SECTION("a window is the file's tokens, y one further (known answer)") {
    TokenLoader tiled(file, {.block_size = 8, .loader = {.batch_size = 3}});
    CHECK(tiled.size() == 42);  // (1000 - 1) / 8 = 124 windows, in batches of 3
    auto it = tiled.begin();
    const auto& b = *it;
    for (int64_t r = 0; r < 3; ++r) {
      for (int64_t t = 0; t < 8; ++t) {
        CHECK(b.data[r][t].item<int64_t>() == ids[r * 8 + t]);
        CHECK(b.target[r][t].item<int64_t>() == ids[r * 8 + t + 1]);
      }
    }
  }
  SECTION("a state taken mid-epoch resumes with the batches the uninterrupted pass reads next") {
    for (const Windows w : {Windows::tiled, Windows::random}) {
      const TokenLoader::Options o{.block_size = 8, .windows = w, .windows_per_epoch = 60,
                                   .loader = {.batch_size = 4, .shuffle = true, .seed = 5}};
      TokenLoader whole(file, o), first(file, o);
      whole.set_epoch(1);
      first.set_epoch(1);
      std::vector<torch::Tensor> expected;
      for (const auto& b : whole) expected.push_back(torch::cat({b.data, b.target}, 1));
      int64_t k = 0;
      for (const auto& b : first) {
        (void)b;
        if (++k == 6) break;
      }
      TokenLoader resumed(file, o);
      resumed.load_state_dict(first.state_dict());
      resumed.set_epoch(1);
      std::size_t i = 6;
      for (const auto& b : resumed) {
        REQUIRE(i < expected.size());
        CHECK(torch::equal(torch::cat({b.data, b.target}, 1), expected[i++]));
      }
      CHECK(i == expected.size());
    }
  }
  SECTION("bad files and options are refused with one line") {
    const auto refused = [](const fs::path& p) {
      try {
        volt::data::TokenFile f(p);
      } catch (const std::invalid_argument& e) {
        return std::string(e.what());
      }
      return std::string("accepted");
    };
    const std::string two = std::string("\x01\x00\x02\x00", 4);
    CHECK(refused(dir / "none.bin") ==
          "volt: token file " + (dir / "none.bin").string() + ": cannot open it: No such file or directory");
    const fs::path odd = write_bytes(dir / "odd.bin", "abc");
    CHECK(refused(odd) == "volt: token file " + odd.string() + ": 3 bytes is not a whole number of uint16 ids (2 bytes "
                          "each); give its type (nanoGPT's .bin files hold uint16)");
    const fs::path big_endian = write_bytes(dir / "be.npy", npy("{'descr': '>u2', 'fortran_order': False, 'shape': (2,), }", two));
    CHECK(refused(big_endian) == "volt: token file " + big_endian.string() + ": its ids are '>u2'; token files hold "
                                 "'|u1', '<u2', '<i4', '<u4' or '<i8' (little-endian integers)");
    const fs::path matrix = write_bytes(dir / "m.npy", npy("{'descr': '<u2', 'fortran_order': False, 'shape': (1, 2), }", two));
    CHECK(refused(matrix) == "volt: token file " + matrix.string() + ": its shape is (1, 2); a token file is one flat "
                             "array, shape (N,)");
    const fs::path short_data = write_bytes(dir / "s.npy", npy("{'descr': '<u2', 'fortran_order': False, 'shape': (3,), }", two));
    CHECK(refused(short_data) == "volt: token file " + short_data.string() + ": its header says 3 ids (6 bytes), and 4 "
                                 "bytes follow it");
    const fs::path text = write_bytes(dir / "t.npy", "hello, world");
    CHECK(refused(text) == "volt: token file " + text.string() + ": not a .npy file (no \\x93NUMPY magic)");
    CHECK_THROWS_WITH(TokenLoader(volt::data::TokenFile(write_bytes(dir / "tiny.bin", two)), {.block_size = 2}),
                      "volt: TokenLoader over " + (dir / "tiny.bin").string() + ": it holds 2 tokens, fewer than one "
                      "window of block_size + 1 = 3.");
    CHECK_THROWS_WITH(TokenLoader(file, {.block_size = 0}),
                      "volt: TokenLoader over " + bin.string() + ": block_size=0 is not allowed: give a number >= 1.");
  }
  SECTION("a file is mapped, not read: 1 GiB of ids costs the pages its windows touch") {
    const fs::path huge = dir / "huge.bin";
    { std::ofstream(huge, std::ios::binary).put('\0'); }
    fs::resize_file(huge, int64_t{1} << (vt::sanitized ? 26 : 30));  // sparse: no disk, and reads as zeros
    const int64_t before = resident_bytes();
    TokenLoader loader(volt::data::TokenFile(huge), {.block_size = 1024, .windows = Windows::random,
                                                     .windows_per_epoch = 64, .loader = {.batch_size = 8}});
    int64_t read = 0;
    for (const auto& b : loader) read += b.data.numel() + b.target.numel();
    const int64_t grown = resident_bytes() - before;
    INFO("resident memory grew by " << grown / 1024 << " KiB reading " << read << " ids of a "
                                     << (fs::file_size(huge) >> 20) << " MiB file");
    CHECK(read == 64 * 2 * 1024);
    if (!vt::sanitized) CHECK(grown < (int64_t{32} << 20));  // the windows' pages (64 x 2 KiB) and the batches
    fs::remove(huge);
  }
}

TEST_CASE("token files of every type, written by NumPy, read as NumPy reads them", "[.tokens_export]") {
  const char* env = std::getenv("VOLT_TOKENS_DIR");
  REQUIRE(env != nullptr);
  const fs::path dir = env;  // test/tokens_check.py wrote the files and compares what is written here
  using volt::data::TokenLoader;
  for (const std::string name : {"u16.bin", "u8.npy", "u16.npy", "i32.npy", "u32.npy", "i64.npy"}) {
    const volt::data::TokenFile file(dir / name);
    for (const auto w : {volt::data::Windows::tiled, volt::data::Windows::random}) {
      TokenLoader loader(file, {.block_size = 16, .windows = w, .windows_per_epoch = 40,
                                .loader = {.batch_size = 4, .shuffle = true, .seed = 9, .num_workers = 2}});
      std::ofstream out(dir / (name + (w == volt::data::Windows::tiled ? ".tiled.i64" : ".random.i64")), std::ios::binary);
      for (int64_t epoch = 0; epoch < 2; ++epoch) {
        loader.set_epoch(epoch);
        write_windows(loader, out);
      }
    }
    const TokenLoader whole(file, {.block_size = 16, .loader = {.batch_size = 4, .shuffle = true, .drop_last = true}});
    for (int rank = 0; rank < 2; ++rank) {
      auto shard = whole.shard(rank, 2);
      std::ofstream out(dir / (name + ".rank" + std::to_string(rank) + ".i64"), std::ios::binary);
      write_windows(shard, out);
    }
  }
}
