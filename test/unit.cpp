// Unit tests on their own, on CPU tensors: the C++ runtime volt links, the shipped policies against their kinds,
// options, Context::log, cluster environments and the distributed pieces that run in one process.

#include "common.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>

// ---- the C++ runtime ----------------------------------------------------------------------------------

// pip's LibTorch exports a copy of std::filesystem whose remove_all jumps to address 0; volt::volt links
// libstdc++ first so that programs bind to the runtime's own copy (CMakeLists.txt, VOLT_LIBSTDCXX_FIRST): the shared
// libstdc++, or the program itself where the compiler links libstdc++ statically.
TEST_CASE("std::filesystem calls reach the C++ runtime, not a copy inside LibTorch", "[unit]") {
  using RemoveAll = std::uintmax_t (*)(const std::filesystem::path&);
  const RemoveAll remove_all = &std::filesystem::remove_all;
  Dl_info info{};
  REQUIRE(::dladdr(reinterpret_cast<void*>(remove_all), &info) != 0);
  REQUIRE(info.dli_fname != nullptr);
  INFO("std::filesystem::remove_all resolves into " << info.dli_fname);
  CHECK_THAT(info.dli_fname, !Contains("libtorch"));
  // And the call that crashed: a tree of folders and a file.
  const auto dir = std::filesystem::temp_directory_path() / ("volt_fs_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "a" / "b");
  std::ofstream(dir / "a" / "b" / "f") << "x";
  CHECK(std::filesystem::remove_all(dir) == 4);
  CHECK_FALSE(std::filesystem::exists(dir));
}

// ---- what makes a CPU run slow ---------------------------------------------------------------------------

namespace {
/// A process of this job on a host of `cores` cores without hyper-threads, nothing bound, no quota.
volt::detail::CpuView plain_host(int threads, int cores, int ranks = 1) {
  volt::detail::CpuView v;
  v.threads = threads;
  v.affinity = v.affinity_cores = v.host = v.host_cores = cores;
  v.ranks = ranks;
  return v;
}

/// Runs this test program's `[.cpu_notices_child]` with `env` set ("NAME=value ..."); its stdout and stderr.
std::string run_notices_child(const std::string& env) {
  const std::string cmd = env + " '" + fs::read_symlink("/proc/self/exe").string() + "' '[.cpu_notices_child]' 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof(buf), pipe)) out.append(buf, n);
  INFO(cmd << "\n" << out);
  REQUIRE(::pclose(pipe) == 0);
  return out;
}

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

/// Writes `text` to `file`, making its folders.
void put(const fs::path& file, const std::string& text) {
  fs::create_directories(file.parent_path());
  std::ofstream(file) << text;
}
}  // namespace

TEST_CASE("CPU thread findings: known answers for threads, binding, ranks and quotas", "[unit]") {
  using volt::detail::thread_findings;
  CHECK(thread_findings(plain_host(2, 2)).empty());
  CHECK(thread_findings(plain_host(16, 16)).empty());
  // one thread where 2 cores are free (OMP_NUM_THREADS=1, or LibTorch's own count reading low)
  auto one = plain_host(1, 2);
  one.omp_num_threads = "1";
  auto said = thread_findings(one);
  REQUIRE(said.size() == 1);
  CHECK_THAT(said[0], Contains("1 intra-op thread while this process may use 2 cores") &&
                          Contains("OMP_NUM_THREADS=1 is set") && Contains("set OMP_NUM_THREADS=2."));
  CHECK(said[0].size() <= 120);  // one short line
  CHECK(thread_findings(plain_host(3, 4)).empty());  // 3 of 4: not half
  // 8 cores with 2 hyper-threads each: LibTorch's 8 threads are right, 16 are not too many
  auto smt = plain_host(8, 16);
  smt.affinity_cores = smt.host_cores = 8;
  CHECK(thread_findings(smt).empty());
  smt.threads = 16;
  CHECK(thread_findings(smt).empty());
  // taskset to 5 of 8 cores with 4 threads: not half of the 5 it may use (the 8 are not its to use)
  auto five = plain_host(4, 8);
  five.affinity = five.affinity_cores = 5;
  CHECK(thread_findings(five).empty());
  five.threads = 2;
  said = thread_findings(five);
  REQUIRE(said.size() == 1);
  CHECK_THAT(said[0], Contains("may use 5 cores") && Contains("OMP_NUM_THREADS=5"));
  // mpirun -np 1 on 16 cores: bound to one core; the same binding by taskset; none said under SLURM
  auto bound = plain_host(1, 16);
  bound.affinity = bound.affinity_cores = 1;
  bound.under_mpirun = true;
  said = thread_findings(bound);
  REQUIRE(said.size() == 1);
  CHECK_THAT(said[0], Contains("1 core only") && Contains("--bind-to none") && Contains("PE=16"));
  bound.under_mpirun = false;
  said = thread_findings(bound);
  REQUIRE(said.size() == 1);
  CHECK_THAT(said[0], Contains("1 core only") && Contains("taskset") && !Contains("mpirun"));
  bound.under_scheduler = true;
  CHECK(thread_findings(bound).empty());
  // 2 ranks on 2 cores, each bound to its own: right; each unbound with 2 threads: 4 threads on 2 CPUs
  auto pair = plain_host(1, 2, 2);
  pair.affinity = pair.affinity_cores = 1;
  CHECK(thread_findings(pair).empty());
  said = thread_findings(plain_host(2, 2, 2));
  REQUIRE(said.size() == 1);
  CHECK_THAT(said[0], Contains("2 intra-op threads per process where each may have 1 CPU") &&
                          Contains("for 2 ranks") && Contains("OMP_NUM_THREADS=1 for each rank"));
  // 8 ranks on 64 cores, unbound, 8 threads each: right
  CHECK(thread_findings(plain_host(8, 64, 8)).empty());
  // a container's quota of 2 CPUs on a 64-core host, LibTorch running 64 threads
  auto quota = plain_host(64, 64);
  quota.quota = 2;
  said = thread_findings(quota);
  REQUIRE(said.size() == 1);
  CHECK_THAT(said[0], Contains("may have 2 CPUs") && Contains("quota") && Contains("OMP_NUM_THREADS=2"));
  quota.threads = 2;
  CHECK(thread_findings(quota).empty());
}

TEST_CASE("CPU lists, cgroup cpusets and quotas in the kernel's formats, v1 and v2", "[unit]") {
  using volt::detail::parse_cpu_list;
  CHECK(parse_cpu_list("0-3,8,10-11\n") == std::vector<int>{0, 1, 2, 3, 8, 10, 11});
  CHECK(parse_cpu_list("5") == std::vector<int>{5});
  CHECK(parse_cpu_list("3-1").empty());
  CHECK(parse_cpu_list("max").empty());
  const fs::path root = scratch("cgroups");
  put(root / "sys/devices/system/cpu/online", "0-63\n");
  SECTION("v2: the cpuset of a parent, the tightest quota on the way up") {
    put(root / "proc/self/cgroup", "0::/job/step/task\n");
    put(root / "sys/fs/cgroup/cgroup.controllers", "cpuset cpu\n");
    put(root / "sys/fs/cgroup/cpuset.cpus.effective", "0-63\n");
    put(root / "sys/fs/cgroup/job/cpuset.cpus.effective", "4-7,12\n");
    put(root / "sys/fs/cgroup/job/cpu.max", "300000 100000\n");
    put(root / "sys/fs/cgroup/job/step/cpu.max", "150000 100000\n");
    put(root / "sys/fs/cgroup/job/step/task/cpu.max", "max 100000\n");
    CHECK(volt::detail::host_cpus(root) == std::vector<int>{4, 5, 6, 7, 12});
    CHECK(volt::detail::cgroup_cpu_quota(root) == std::optional<int>(2));  // 1.5 CPUs, rounded up
  }
  SECTION("v2 at the root cgroup, nothing limited: the online CPUs") {
    put(root / "proc/self/cgroup", "0::/\n");
    put(root / "sys/fs/cgroup/cgroup.controllers", "cpuset cpu\n");
    put(root / "sys/fs/cgroup/cpu.max", "max 100000\n");
    CHECK(volt::detail::host_cpus(root).size() == 64);
    CHECK_FALSE(volt::detail::cgroup_cpu_quota(root).has_value());
  }
  SECTION("v1 (a SLURM job's cpuset, a cfs quota), v2 unified beside it") {
    put(root / "proc/self/cgroup", "12:cpu,cpuacct:/slurm/job1\n3:cpuset:/slurm/job1/step0\n0::/\n");
    put(root / "sys/fs/cgroup/unified/cgroup.controllers", "\n");
    put(root / "sys/fs/cgroup/cpuset/slurm/job1/cpuset.cpus", "2-3\n");
    put(root / "sys/fs/cgroup/cpuset/slurm/job1/step0/cpuset.effective_cpus", "2\n");
    put(root / "sys/fs/cgroup/cpu,cpuacct/slurm/job1/cpu.cfs_quota_us", "400000\n");
    put(root / "sys/fs/cgroup/cpu,cpuacct/slurm/job1/cpu.cfs_period_us", "100000\n");
    put(root / "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
    put(root / "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n");
    CHECK(volt::detail::host_cpus(root) == std::vector<int>{2});
    CHECK(volt::detail::cgroup_cpu_quota(root) == std::optional<int>(4));
  }
  fs::remove_all(root);
}

// Two fits in one process, the BLAS volt finds, then the BLAS files the process has mapped (the kernel's list).
TEST_CASE("two fits, then the BLAS files this process has mapped", "[.cpu_notices_child]") {
  auto [x, y] = vt::regression_data(32);
  for (int fit = 0; fit < 2; ++fit) {
    vt::Regressor m;
    auto loader = make_loader(x, y, 16);
    volt::Trainer<volt::SingleDevice, volt::Fp32, volt::CPU> trainer(volt::TrainerOptions{.max_epochs = 1});
    trainer.fit(*m, loader);
  }
  std::cout << "blas: " << volt::blas_info().name << "\n";
  std::ifstream maps("/proc/self/maps");
  std::set<std::string> files;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("blas") != std::string::npos) files.insert(line.substr(line.find('/')));
  }
  for (const auto& f : files) std::cout << "mapped: " << f << "\n";
}

// Debian's LibTorch multiplies through libblas.so.3: forced to netlib's reference BLAS, a fit says so once per
// process; forced to OpenBLAS, never. pip's LibTorch (MKL inside) maps no libblas and is never warned about.
TEST_CASE("a fit says once that LibTorch runs on the reference BLAS, and never on OpenBLAS", "[unit]") {
#if defined(__x86_64__)
  const std::string lib = "/usr/lib/x86_64-linux-gnu/";
#elif defined(__aarch64__)
  const std::string lib = "/usr/lib/aarch64-linux-gnu/";
#endif
  const std::string notice = "on the reference BLAS";
  auto forced = [&](const std::string& folder) {
    return run_notices_child("LD_LIBRARY_PATH=" + lib + folder + "${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}");
  };
  const std::string reference = forced("blas"), openblas = forced("openblas-openmp");
  INFO(reference << "\n" << openblas);
#if TORCH_VERSION_MAJOR < 2  // Debian's libtorch-dev; scripts/install-deps.sh --tests installs both libraries
  REQUIRE(fs::exists(lib + "blas/libblas.so.3"));
  REQUIRE(fs::exists(lib + "openblas-openmp/libblas.so.3"));
  REQUIRE_THAT(reference, Contains("mapped: " + lib + "blas/libblas.so"));
  CHECK_THAT(reference, Contains("blas: reference\n"));
  CHECK(count_of(reference, notice) == 1);
  CHECK_THAT(reference, Contains("apt-get install libopenblas0-openmp"));
  CHECK_THAT(openblas, Contains("blas: OpenBLAS (OpenMP)\n"));
#else  // pip's LibTorch: MKL linked in, no libblas.so.3 loaded
  CHECK_THAT(reference, Contains("blas: MKL\n") && !Contains("mapped: " + lib + "blas/"));
  CHECK(count_of(reference, notice) == 0);
  CHECK_THAT(openblas, Contains("blas: MKL\n"));
#endif
  CHECK(count_of(openblas, notice) == 0);
  CHECK(count_of(openblas, "mapped: " + lib + "blas/") == 0);
}

TEST_CASE("a fit says once that OMP_NUM_THREADS=1 leaves cores idle", "[unit]") {
  const auto v = volt::detail::read_cpu_view(1);
  if (v.host_cores < 2 || v.affinity_cores < v.host_cores || v.quota || v.under_scheduler) {
    WARN("this process may use " << v.affinity_cores << " of " << v.host_cores << " cores (quota: "
                                 << v.quota.value_or(0) << "): not the plain host this test needs, not checked");
    return;
  }
  const std::string out = run_notices_child("OMP_NUM_THREADS=1");
  INFO(out);
  CHECK(count_of(out, "LibTorch runs 1 intra-op thread while") == 1);
  CHECK(count_of(out, "OMP_NUM_THREADS=1 is set") == 1);
  const std::string full = run_notices_child("OMP_NUM_THREADS=" + std::to_string(v.affinity_cores));
  INFO(full);
  CHECK(count_of(full, "intra-op thread") == 0);
}

// ---- concept truth tables ------------------------------------------------------------------------------

// The concept truth table is test/static/rules.cpp (built, not run); the modules' concepts are checked here, against
// the test models.
TEST_CASE("the test models model a module", "[unit]") {
  STATIC_REQUIRE(volt::Module<vt::Regressor>);
  STATIC_REQUIRE(volt::Module<vt::RegressorImpl>);
  STATIC_REQUIRE(volt::TrainableOn<vt::Regressor, torch::data::Example<>>);
  STATIC_REQUIRE_FALSE(volt::TrainableOn<vt::Regressor, torch::Tensor>);
  STATIC_REQUIRE_FALSE(volt::Module<torch::nn::LinearImpl>);
}

// ---- options ------------------------------------------------------------------------------------------------

TEST_CASE("seed_everything makes weights built before fit the same in every run", "[unit]") {
  // The reference: LibTorch's own manual_seed, then the same module built.
  torch::manual_seed(123);
  torch::nn::Linear reference(8, 3);
  volt::seed_everything(999);
  torch::nn::Linear other(8, 3);
  CHECK(volt::seed_everything(123) == 123);
  torch::nn::Linear again(8, 3);
  CHECK(torch::equal(again->weight, reference->weight));
  CHECK(torch::equal(again->bias, reference->bias));
  CHECK(!torch::equal(other->weight, reference->weight));
}

TEST_CASE("Limit resolves counts and fractions as Lightning", "[unit]") {
  CHECK(volt::Limit(5).resolve(10, "x") == 5);
  CHECK(volt::Limit(50).resolve(10, "x") == 10);
  CHECK(volt::Limit(0.25).resolve(10, "x") == 2);
  CHECK(volt::Limit(1.0).resolve(10, "x") == 10);
  CHECK(volt::Limit(1.0).resolve(-1, "x") == -1);
  CHECK(volt::Limit(7).resolve(-1, "x") == 7);
  CHECK(volt::Limit(0).resolve(10, "x") == 0);
  CHECK(volt::Limit(0.0).resolve(10, "x") == 0);
  CHECK_THROWS_WITH(volt::Limit(0.05).resolve(10, "limit_val_batches"),
                    Contains("limit_val_batches=0.05") && Contains("less than one batch"));
}

TEST_CASE("Context::log refuses values that cannot be logged", "[unit]") {
  volt::detail::LoopState state;
  volt::detail::MetricStore store;
  volt::Context ctx(state, store);
  state.in_batch = true;
  CHECK_THROWS_WITH(ctx.log("v", torch::ones({3})), Contains("3 elements"));
  CHECK_THROWS_WITH(ctx.log("v", 1.0, {.on_step = false, .on_epoch = false}), Contains("record nothing"));
  ctx.log("v", 1.0, {.on_step = true, .on_epoch = false});
  CHECK_THROWS_WITH(ctx.log("v", 1.0, {.on_step = false, .on_epoch = true}), Contains("different"));
  state.in_batch = false;
  CHECK_THROWS_WITH(ctx.log("w", 1.0, {.on_step = true}), Contains("outside a step"));
}

// ---- distributed pieces that run in one process -------------------------------------------------------

namespace {
/// Sets environment variables for one scope, restoring what was there.
struct EnvGuard {
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  void set(const std::string& k, const std::string& v) {
    const char* old = std::getenv(k.c_str());
    saved.emplace_back(k, old ? std::optional<std::string>(old) : std::nullopt);
    ::setenv(k.c_str(), v.c_str(), 1);
  }
  ~EnvGuard() {
    for (auto it = saved.rbegin(); it != saved.rend(); ++it) {
      if (it->second) ::setenv(it->first.c_str(), it->second->c_str(), 1);
      else ::unsetenv(it->first.c_str());
    }
  }
};
}  // namespace

TEST_CASE("cluster environments: Open MPI, SLURM, torchrun variables and contradictions", "[unit][dist]") {
  REQUIRE(std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr);  // the test itself runs plainly
  SECTION("none") { CHECK(volt::cluster::detect().source == volt::cluster::Source::none); }
  SECTION("Open MPI") {
    EnvGuard g;
    g.set("OMPI_COMM_WORLD_SIZE", "8");
    g.set("OMPI_COMM_WORLD_RANK", "5");
    g.set("OMPI_COMM_WORLD_LOCAL_RANK", "1");
    g.set("OMPI_COMM_WORLD_LOCAL_SIZE", "4");
    const auto e = volt::cluster::detect();
    CHECK(e.source == volt::cluster::Source::open_mpi);
    CHECK((e.world_size == 8 && e.rank == 5 && e.local_rank == 1));
    CHECK_NOTHROW(volt::cluster::check_against(e, 4, 2));
    CHECK_THROWS_WITH(volt::cluster::check_against(e, 2, 1),
                      Contains("started 8 processes") && Contains("devices=2 x num_nodes=1 = 2"));
  }
  SECTION("SLURM inside a step") {
    EnvGuard g;
    g.set("SLURM_STEP_NUM_TASKS", "4");
    g.set("SLURM_PROCID", "3");
    g.set("SLURM_LOCALID", "1");
    g.set("SLURM_NODEID", "1");
    const auto e = volt::cluster::detect();
    CHECK((e.source == volt::cluster::Source::slurm && e.rank == 3 && e.local_rank == 1));
  }
  SECTION("torchrun") {
    EnvGuard g;
    g.set("WORLD_SIZE", "2");
    g.set("RANK", "1");
    g.set("LOCAL_RANK", "1");
    const auto e = volt::cluster::detect();
    CHECK((e.source == volt::cluster::Source::torchrun && e.world_size == 2 && e.rank == 1));
  }
  SECTION("a variable that is not a number") {
    EnvGuard g;
    g.set("OMPI_COMM_WORLD_SIZE", "two");
    CHECK_THROWS_WITH(volt::cluster::detect(), Contains("OMPI_COMM_WORLD_SIZE=\"two\""));
  }
}

TEST_CASE("local and node ranks from the members' hosts, whatever the mapping", "[unit][dist]") {
  using volt::detail::place;
  // mpirun --map-by node over three hosts: ranks go round the hosts; rank / local size would say 0,0,1,1,2,2
  const auto by_node = place({"b", "c", "a", "b", "c", "a"});
  CHECK(by_node.node_rank == std::vector<int>{0, 1, 2, 0, 1, 2});
  CHECK(by_node.local_rank == std::vector<int>{0, 0, 0, 1, 1, 1});
  CHECK(by_node.nodes == 3);
  // by slot, two hosts of unequal sizes
  const auto by_slot = place({"n1", "n1", "n1", "n2"});
  CHECK(by_slot.node_rank == std::vector<int>{0, 0, 0, 1});
  CHECK(by_slot.local_rank == std::vector<int>{0, 1, 2, 0});
  CHECK(place({"solo"}).nodes == 1);
}

TEST_CASE("the flight recorder numbers, tags and describes collectives; heartbeats carry its progress", "[unit][dist]") {
  using volt::detail::Collective;
  volt::detail::FlightRecorder r;
  volt::detail::collective_tag().step = 7;
  const uint64_t a = r.issue(Collective::all_reduce, 4096);
  uint64_t b = 0;
  {
    const volt::detail::BucketTag tag(2);
    b = r.issue(Collective::reduce_scatter, 512);
  }
  const uint64_t c = r.issue(Collective::barrier, 0);
  volt::detail::collective_tag().step = -1;
  CHECK((a == 1 && b == 2 && c == 3));
  r.complete(a);
  r.complete(b);
  CHECK(volt::detail::describe(r.entry(b)) == "reduce-scatter #2 (step 7, bucket 2, 512 bytes)");
  CHECK(volt::detail::describe(r.entry(c)) == "barrier #3 (step 7, 0 bytes)");
  const volt::detail::Progress p = r.progress();  // what a heartbeat carries
  CHECK((p.issued() == 3 && p.completed() == 2));
  CHECK(p.last_issued() == "barrier #3 (step 7, 0 bytes)");
  const std::string recent = r.recent(2);
  CHECK_THAT(recent, StartsWith("reduce-scatter #2 (step 7, bucket 2, 512 bytes), done in 0.0 s; barrier #3"));
  CHECK_THAT(recent, Contains("in flight for"));
  // Only the last 32 are kept: the 33rd issue overwrites the first.
  for (int i = 0; i < 30; ++i) r.issue(Collective::broadcast, 8);
  CHECK(r.entry(1).seq == 0);
  CHECK(r.entry(33).seq == 33);
}

TEST_CASE("DDP at world size 1 (MPI singleton, real reducer) trains as SingleDevice", "[unit][dist]") {
  auto [x, y] = vt::regression_data(64);
  vt::Regressor a, b;
  vt::copy_weights(*a, *b);
  volt::Trainer<volt::SingleDevice> single({.max_epochs = 2, .accumulate_grad_batches = 2});
  volt::Trainer<volt::DDP<volt::Script>> ddp({.max_epochs = 2, .accumulate_grad_batches = 2});
  single.fit(a, volt::data::TensorLoader(x, y, {.batch_size = 8, .shuffle = true, .seed = 2}));
  ddp.fit(b, volt::data::TensorLoader(x, y, {.batch_size = 8, .shuffle = true, .seed = 2}));
  CHECK(ddp.strategy().world_size() == 1);
  CHECK(ddp.strategy().bucket_layout().size() == 1);  // two small parameters: one bucket
  CHECK(torch::allclose(vt::flat_params(*a), vt::flat_params(*b), 1e-6, 1e-7));
  CHECK(volt::detail::MpiRuntime::instance().initialized());
}

/// A chain of `n` parameters of 250 elements, h = tanh(h * p_i): backward reaches the last first and p0 last. `copies`
/// hold the reference gradients (plain autograd) once made.
struct TanhChain {
  std::vector<torch::Tensor> params, copies;
  torch::Tensor x;
  TanhChain(int n, uint64_t seed) {
    torch::manual_seed(seed);
    for (int i = 0; i < n; ++i) {
      params.push_back(torch::randn({250}).requires_grad_(true));
      copies.push_back(params.back().detach().clone().requires_grad_(true));
    }
    x = torch::randn({250});
    loss_of(copies).backward();
  }
  torch::Tensor loss_of(const std::vector<torch::Tensor>& ps) const {
    torch::Tensor h = x;
    for (const auto& p : ps) h = torch::tanh(h * p);
    return h.sum();
  }
};

TEST_CASE("ZeRO stage 2's reducer: at most two buckets alive during backward, each .grad dropped, blocks averaged",
          "[unit][dist]") {
  TanhChain chain(6, 3);  // one parameter per bucket
  auto& [params, copies, x] = chain;
  volt::Mpi world_of_one;
  volt::detail::Reducer<volt::Mpi> reducer(params, world_of_one, 1, 1000, 1000,
                                            volt::detail::GradSync::reduce_scatter_to_blocks);
  REQUIRE(reducer.num_buckets() == 6);
  std::size_t most_alive = 0, grads_alive = 0;
  for (auto& p : params) {  // runs as each gradient reaches its parameter, before its accumulator
    p.register_hook([&](const torch::Tensor&) {
      std::size_t alive = 0;
      for (const auto& b : reducer.buckets()) alive += b.flat.defined() ? 1 : 0;
      most_alive = std::max(most_alive, alive);
      for (const auto& q : params) grads_alive += q.grad().defined() ? 1 : 0;
    });
  }
  reducer.prepare(/*sync=*/true);
  chain.loss_of(params).backward();
  reducer.finish();
  CHECK(most_alive == 2);  // volt::detail::kBucketsInFlight
  CHECK(grads_alive == 0);  // each .grad went into its bucket and was dropped before the next gradient arrived
  std::size_t block_bytes = 0;
  for (std::size_t i = 0; i < 6; ++i) {
    const std::size_t j = reducer.buckets()[i].members.front();
    CHECK(j == 5 - i);
    CHECK(!params[j].grad().defined());
    CHECK(torch::allclose(reducer.blocks()[i], copies[j].grad()));
    block_bytes += volt::detail::bytes_of(reducer.blocks()[i]);
  }
  CHECK(reducer.gradient_bytes() == block_bytes);
}

TEST_CASE("FSDP's gradient buckets take their memory from the pool units are gathered into, and give it back",
          "[unit][dist]") {
  TanhChain chain(3, 4);
  auto& [params, copies, x] = chain;
  // A block of 1500 bytes in the pool, which only the pool can give a 1000-byte bucket (at most twice the size).
  volt::detail::BufferPool pool;
  c10::Allocator* cpu = c10::GetAllocator(c10::DeviceType::CPU);
  std::size_t capacity = 0;
  at::DataPtr seeded = pool.take(cpu, 1500, capacity);
  const void* seeded_memory = seeded.get();
  pool.give(std::move(seeded), capacity);
  volt::Mpi world_of_one;
  volt::detail::Reducer<volt::Mpi> reducer(params, world_of_one, 1, {{2}, {1}, {0}},
                                            volt::detail::GradSync::reduce_scatter_to_blocks);
  reducer.use_pool(pool);
  std::vector<std::size_t> bucket_bytes;
  for (auto& p : params) {
    p.register_hook([&](const torch::Tensor&) {
      for (const auto& b : reducer.buckets()) {
        if (b.flat.defined()) bucket_bytes.push_back(b.flat.storage().nbytes());
      }
    });
  }
  reducer.prepare(/*sync=*/true);
  chain.loss_of(params).backward();
  reducer.finish();
  REQUIRE(!bucket_bytes.empty());
  CHECK(bucket_bytes.front() == 1500);  // the first bucket was the pool's block
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(!reducer.buckets()[i].flat.defined());
    CHECK(torch::allclose(reducer.blocks()[i], copies[2 - i].grad()));
  }
  // The block went back once its bucket was done (the other buckets' 1000-byte blocks too, too small for 1200).
  at::DataPtr back = pool.take(cpu, 1200, capacity);
  CHECK(capacity == 1500);
  CHECK(back.get() == seeded_memory);
}

TEST_CASE("FSDP's buffer pool: a freed unit's block comes back for the next unit that fits it",
          "[unit][dist]") {
  volt::detail::BufferPool pool(2);
  SECTION("blocks: the smallest that fits and is at most twice the size; the smallest goes past the bound") {
    c10::Allocator* cpu = c10::GetAllocator(c10::DeviceType::CPU);
    std::size_t capacity = 0;
    at::DataPtr big = pool.take(cpu, 1000, capacity);
    CHECK(capacity == 1000);
    const void* big_memory = big.get();
    pool.give(std::move(big), capacity);
    CHECK(pool.take(cpu, 400, capacity).get() != big_memory);  // 1000 is more than twice 400: a new block
    CHECK(capacity == 400);
    at::DataPtr reused = pool.take(cpu, 600, capacity);
    CHECK(reused.get() == big_memory);
    CHECK(capacity == 1000);
    at::DataPtr a = pool.take(cpu, 500, capacity), b = pool.take(cpu, 2000, capacity);
    pool.give(std::move(reused), 1000);
    pool.give(std::move(a), 500);
    pool.give(std::move(b), 2000);  // three kept, bound two: the 500-byte one goes, so 500 bytes get the 1000
    CHECK(pool.take(cpu, 500, capacity).get() == big_memory);
    CHECK(capacity == 1000);
  }
}

TEST_CASE("SingleDevice refuses to run as one of several processes of an mpirun, srun or torchrun job",
          "[unit][dist]") {
  auto single = [] { volt::Trainer<> t; };
  SECTION("Open MPI, 2 processes") {
    EnvGuard g;
    g.set("OMPI_COMM_WORLD_SIZE", "2");
    g.set("OMPI_COMM_WORLD_RANK", "1");
    CHECK_THROWS_WITH(single(), Contains("SingleDevice trains in one process, but Open MPI started 2 (this is rank 1)") &&
                                    Contains("DDP<Script> with devices x num_nodes = 2"));
  }
  SECTION("torchrun, 4 processes") {
    EnvGuard g;
    g.set("WORLD_SIZE", "4");
    g.set("RANK", "0");
    CHECK_THROWS_WITH(single(), Contains("torchrun started 4"));
  }
  SECTION("one process of a job, or a process volt's own launcher started, is fine") {
    EnvGuard g;
    g.set("OMPI_COMM_WORLD_SIZE", "1");
    g.set("OMPI_COMM_WORLD_RANK", "0");
    CHECK_NOTHROW(single());
    g.set("OMPI_COMM_WORLD_SIZE", "2");
    g.set("VOLT_LAUNCH_ROLE", "spawn");
    CHECK_NOTHROW(single());
  }
}

// Run by CTest under a real `mpirun -np 2` (unit.single_device_under_mpirun), not with the other [unit] cases.
TEST_CASE("under mpirun -np 2, a SingleDevice Trainer says so on every rank", "[.mpirun_single]") {
  REQUIRE(std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr);
  CHECK_THROWS_WITH(volt::Trainer<>(), Contains("SingleDevice trains in one process, but Open MPI started 2"));
}

TEST_CASE("Spawn refuses to run inside a job started by mpirun", "[unit][dist]") {
  {
    EnvGuard g;
    g.set("OMPI_COMM_WORLD_SIZE", "2");
    g.set("OMPI_COMM_WORLD_RANK", "0");
    auto [x, y] = vt::regression_data(16);
    vt::Regressor m;
    volt::Trainer<volt::DDP<volt::Spawn>> t({.devices = 2});
    CHECK_THROWS_WITH(t.fit(m, volt::data::TensorLoader(x, y, {.batch_size = 8})),
                      Contains("DDP<Spawn> inside a job started by Open MPI") && Contains("Use DDP<Script>"));
  }
  CHECK_FALSE(volt::Spawn::is_worker());
}

// ---- configuration from files and flags (volt/config.hpp) -------------------------------------------------------

namespace {

/// Two sets of TrainerOptions that together move every field away from its default (overfit_batches cannot stand
/// beside batch limits or fast_dev_run, so it has a set of its own), each set in C++ and written by hand as a JSON
/// file and as flags.
struct OptionsCase {
  volt::TrainerOptions expected;
  std::string file;
  std::vector<std::string> flags;
};

std::vector<OptionsCase> options_cases() {
  using namespace std::chrono_literals;
  OptionsCase a;
  volt::TrainerOptions& o = a.expected;
  o.devices = 3;
  o.num_nodes = 2;
  o.max_epochs = 7;
  o.min_epochs = 2;
  o.max_steps = 900;
  o.min_steps = 5;
  o.max_time = 90min;
  o.limit_train_batches = 0.5;
  o.limit_val_batches = 4;
  o.limit_test_batches = 0.25;
  o.limit_predict_batches = 6;
  o.val_check_interval = 10;
  o.check_val_every_n_epoch = std::nullopt;
  o.num_sanity_val_steps = -1;
  o.accumulate_grad_batches = 4;
  o.gradient_clip_val = 0.5;
  o.gradient_clip_algorithm = volt::ClipAlgorithm::value;
  o.fast_dev_run = 3;
  o.deterministic = true;
  o.benchmark = false;
  o.seed = 18446744073709551615ull;
  o.detect_anomaly = true;
  o.inference_mode = false;
  o.log_every_n_steps = 10;
  o.default_root_dir = "runs/a b";
  o.signals = {.enabled = false, .requeue_signal = SIGUSR2, .auto_requeue = false, .scontrol = "/opt/slurm/scontrol",
               .exit_process = false};
  o.timeout = 45min;
  a.file = R"({"trainer": {"devices": 3, "num_nodes": 2, "max_epochs": 7, "min_epochs": 2, "max_steps": 900,
    "min_steps": 5, "max_time": "1h30min", "limit_train_batches": 0.5, "limit_val_batches": 4,
    "limit_test_batches": 0.25, "limit_predict_batches": 6, "val_check_interval": 10,
    "check_val_every_n_epoch": null, "num_sanity_val_steps": -1, "accumulate_grad_batches": 4,
    "gradient_clip_val": 0.5, "gradient_clip_algorithm": "value", "fast_dev_run": 3, "deterministic": true,
    "benchmark": false, "seed": 18446744073709551615, "detect_anomaly": true, "inference_mode": false,
    "log_every_n_steps": 10, "default_root_dir": "runs/a b",
    // comments are allowed
    "signals": {"enabled": false, "requeue_signal": 12, "auto_requeue": false, "scontrol": "/opt/slurm/scontrol",
                "exit_process": false},
    "timeout": "00:00:45:00"}})";
  a.flags = {"--trainer.devices=3", "--trainer.num_nodes", "2", "--trainer.max_epochs=7", "--trainer.min_epochs=2",
             "--trainer.max_steps=900", "--trainer.min_steps=5", "--trainer.max_time=90min",
             "--trainer.limit_train_batches=0.5", "--trainer.limit_val_batches=4",
             "--trainer.limit_test_batches=2.5e-1", "--trainer.limit_predict_batches=6",
             "--trainer.val_check_interval=10", "--trainer.check_val_every_n_epoch=null",
             "--trainer.num_sanity_val_steps", "-1", "--trainer.accumulate_grad_batches=4",
             "--trainer.gradient_clip_val=0.5", "--trainer.gradient_clip_algorithm=value", "--trainer.fast_dev_run=3",
             "--trainer.deterministic", "--trainer.benchmark=false", "--trainer.seed=18446744073709551615",
             "--trainer.detect_anomaly=true", "--trainer.inference_mode=0", "--trainer.log_every_n_steps=10",
             "--trainer.default_root_dir=runs/a b", "--trainer.signals.enabled=false",
             "--trainer.signals.requeue_signal=12", "--trainer.signals.auto_requeue=false",
             "--trainer.signals.scontrol=/opt/slurm/scontrol", "--trainer.signals.exit_process=false",
             "--trainer.timeout=2700s"};
  OptionsCase b;
  b.expected.overfit_batches = 0.125;
  b.expected.max_epochs = -1;
  b.expected.max_time = 36h;
  b.file = R"({"trainer": {"overfit_batches": 0.125, "max_epochs": -1, "max_time": "1d12h"}})";
  b.flags = {"--trainer.overfit_batches=0.125", "--trainer.max_epochs=-1", "--trainer.max_time=01:12:00:00"};
  return {a, b};
}

/// The options `argv` gives (`--config` files and flags) through a Config with the trainer's section.
volt::TrainerOptions parsed(const std::vector<std::string>& args) {
  volt::TrainerOptions o;
  volt::Config config("test");
  config.add("trainer", o);
  std::vector<const char*> argv{"test"};
  for (const std::string& a : args) argv.push_back(a.c_str());
  std::ostringstream out;
  if (!config.parse(static_cast<int>(argv.size()), argv.data(), out)) FAIL("parse printed instead: " << out.str());
  return o;
}

/// The one-line error `args` give, or "" when they give none.
std::string parse_error(const std::vector<std::string>& args) {
  try {
    (void)parsed(args);
  } catch (const volt::ConfigError& e) {
    return e.what();
  }
  return "";
}

std::string write_file(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path) << text;
  return path.string();
}

}  // namespace

TEST_CASE("every TrainerOptions field set from a file and from flags equals the same option set in C++, and the "
          "printed configuration reads back to it", "[config]") {
  const fs::path dir = scratch("config_fields");
  const std::vector<OptionsCase> cases = options_cases();
  // Together the cases move every field away from its default: a field added to TrainerOptions and not here fails.
  const volt::TrainerOptions defaults;
  auto differs = [&](std::size_t field) {
    bool any = false;
    for (const OptionsCase& c : cases) {
      auto mine = volt::config::detail::tie(c.expected);
      auto theirs = volt::config::detail::tie(defaults);
      [&]<std::size_t... I>(std::index_sequence<I...>) {
        ((I == field && !(std::get<I>(mine) == std::get<I>(theirs)) ? static_cast<void>(any = true)
                                                                    : static_cast<void>(0)), ...);
      }(std::make_index_sequence<std::tuple_size_v<decltype(mine)>>{});
    }
    return any;
  };
  const std::size_t fields = volt::config::detail::field_count<volt::TrainerOptions>();
  for (std::size_t f = 0; f < fields; ++f) {
    INFO("field " << f << " (" << volt::config::detail::docs_of<volt::TrainerOptions>[f].name << ")");
    CHECK(differs(f));
  }
  int n = 0;
  for (const OptionsCase& c : cases) {
    INFO("case " << n);
    const std::string file = write_file(dir / ("case" + std::to_string(n++) + ".json"), c.file);
    CHECK(parsed({"--config", file}) == c.expected);
    CHECK(parsed(c.flags) == c.expected);
    // --print_config prints what --config reads back to the same options.
    volt::TrainerOptions o = c.expected;
    volt::Config config("test");
    config.add("trainer", o);
    const char* argv[] = {"test", "--print_config"};
    std::ostringstream printed;
    CHECK_FALSE(config.parse(2, argv, printed));
    const std::string again = write_file(dir / "printed.json", printed.str());
    CHECK(parsed({"--config", again}) == c.expected);
  }
  // Later flags and files win, in the order given.
  const std::string five = write_file(dir / "five.json", R"({"trainer": {"max_epochs": 5}})");
  CHECK(parsed({"--trainer.max_epochs=3", "--config", five}).max_epochs == 5);
  CHECK(parsed({"--config", five, "--trainer.max_epochs=3"}).max_epochs == 3);
}

TEST_CASE("a misspelt key, a wrong type, an unknown flag and a refused value each give one line naming them",
          "[config]") {
  const fs::path dir = scratch("config_errors");
  const std::string misspelt = write_file(dir / "misspelt.json", R"({"trainer": {"max_epoch": 5}})");
  CHECK(parse_error({"--config", misspelt}) ==
        "volt: " + misspelt + ": unknown option \"trainer.max_epoch\"; did you mean \"trainer.max_epochs\"? (--help "
        "lists every option)");
  const std::string typed = write_file(dir / "typed.json", R"({"trainer": {"deterministic": "yes"}})");
  CHECK(parse_error({"--config", typed}) ==
        "volt: " + typed + ": trainer.deterministic takes true or false; got \"yes\" (a string).");
  const std::string fraction = write_file(dir / "fraction.json", R"({"trainer": {"devices": 1.5}})");
  CHECK(parse_error({"--config", fraction}) ==
        "volt: " + fraction + ": trainer.devices takes an integer; got 1.5 (a number).");
  CHECK(parse_error({"--trainer.max_epochs=five"}) ==
        "volt: --trainer.max_epochs=five: trainer.max_epochs takes an integer, or null (unset); got \"five\".");
  CHECK(parse_error({"--trainer.max_time", "90"}) ==
        "volt: --trainer.max_time 90: trainer.max_time takes a duration such as \"500ms\", \"30s\", \"90min\", \"12h\", "
        "\"1h30min\" or \"DD:HH:MM:SS\", or null (unset); got \"90\".");
  CHECK(parse_error({"--trainer.gradient_clip_algorithm=l2"}) ==
        "volt: --trainer.gradient_clip_algorithm=l2: trainer.gradient_clip_algorithm takes one of norm, value; got "
        "\"l2\".");
  CHECK(parse_error({"--trainer.max_epoch=5"}) ==
        "volt: --trainer.max_epoch=5: unknown option \"trainer.max_epoch\"; did you mean \"trainer.max_epochs\"? "
        "(--help lists every option)");
  CHECK(parse_error({"--max_steps=5"}) ==
        "volt: --max_steps=5: unknown option \"max_steps\"; did you mean \"trainer.max_steps\"? (--help lists every "
        "option)");
  CHECK(parse_error({"--epochs=5"}) ==  // a whole word of one option's name
        "volt: --epochs=5: unknown option \"epochs\"; did you mean \"trainer.max_epochs\"? (--help lists every "
        "option)");
  CHECK(parsed({"--trainer.fast_dev_run"}).fast_dev_run == 1);  // a bare flag, as Lightning's fast_dev_run=True
  CHECK(parsed({"--trainer.fast_dev_run=3"}).fast_dev_run == 3);
  CHECK(parse_error({"--model.width=5"}) ==
        "volt: --model.width=5: unknown option \"model.width\" (--help lists every option)");
  CHECK(parse_error({"--trainer.signals=off"}) ==
        "volt: --trainer.signals=off: trainer.signals is a group of options; give them one by one "
        "(--trainer.signals.<name>=<value>, --help lists them), or as an object in a configuration file.");
  CHECK(parse_error({"--trainer.max_steps"}) ==
        "volt: --trainer.max_steps: trainer.max_steps needs a value (--trainer.max_steps=<value>): it takes an "
        "integer.");
  CHECK(parse_error({"epochs"}) == "volt: unexpected argument \"epochs\": options are flags, "
                                   "--<section>.<option>=<value> (--help lists them).");
  // A value of the right type that TrainerOptions does not allow: validate_options' line.
  CHECK(parse_error({"--trainer.accumulate_grad_batches=0"}) ==
        "volt: accumulate_grad_batches=0 is not allowed: give 1 (no accumulation) or more batches per optimizer step.");
  const std::string broken = write_file(dir / "broken.json", R"({"trainer": {"max_epochs": 5,}})");
  CHECK_THAT(parse_error({"--config", broken}), StartsWith("volt: " + broken + " is not valid JSON: "));
  for (const std::string& e : {parse_error({"--config", misspelt}), parse_error({"--trainer.max_epochs=five"})}) {
    CHECK(e.find('\n') == std::string::npos);
  }
}

namespace {
enum class Width { narrow, wide };
constexpr auto volt_enum_names(Width) {
  using P = std::pair<Width, std::string_view>;
  return std::array{P{Width::narrow, "narrow"}, P{Width::wide, "wide"}};
}
struct ModelSection {
  int64_t layers = 2;
  Width width = Width::narrow;
  std::vector<double> dropout{0.1, 0.2};
  std::optional<std::string> name;
};
constexpr auto volt_fields(const ModelSection*) {
  return volt::fields({{"layers", "transformer blocks"}, {"width", "which width"}, {"dropout", "per block"},
                       {"name", "the run's name"}});
}
}  // namespace

TEST_CASE("a program's own section: its options from flags and files, --help lists every option with its type and "
          "default", "[config]") {
  volt::TrainerOptions trainer{.max_epochs = 5};
  ModelSection model;
  volt::Config config("train", "Trains a model.");
  config.add("trainer", trainer).add("model", model);
  const char* argv[] = {"train", "--model.layers=4", "--model.width", "wide", "--model.dropout=0.5, 0.25",
                        "--model.name=first"};
  std::ostringstream out;
  REQUIRE(config.parse(6, argv, out));
  CHECK(model.layers == 4);
  CHECK(model.width == Width::wide);
  CHECK(model.dropout == std::vector<double>{0.5, 0.25});
  CHECK(model.name == "first");
  CHECK(config.json()["model"] == volt::Json::parse(R"({"layers": 4, "width": "wide", "dropout": [0.5, 0.25],
                                                        "name": "first"})"));
  const std::string help = config.help();
  CHECK_THAT(help, StartsWith("usage: train [--config FILE] [--<section>.<option>=VALUE ...] [--print_config] "
                              "[--help]\nTrains a model.\n"));
  for (const std::string& key : config.keys()) CHECK_THAT(help, Contains("  --" + key + "  ("));
  CHECK(config.keys().size() == volt::config::detail::field_count<volt::TrainerOptions>() - 1 +
                                    volt::config::detail::field_count<volt::SignalOptions>() + 4);
  CHECK_THAT(help, Contains("  --trainer.max_epochs  (an integer, or null (unset); default: 5)\n      stop after"));
  CHECK_THAT(help, Contains("  --model.width  (one of narrow, wide; default: \"wide\")\n      which width"));
  CHECK_THAT(help, Contains("  --trainer.timeout  (a duration such as"));
  const char* help_argv[] = {"train", "--help"};
  std::ostringstream printed;
  CHECK_FALSE(config.parse(2, help_argv, printed));
  CHECK(printed.str() == help);
}
