#pragma once
/// \file
/// volt::MLFlowLogger: a run's metrics, hyper-parameters, tags, end status and (when asked) checkpoints, sent to an
/// MLflow tracking server over its REST protocol, as Lightning's MLFlowLogger. Needs libcurl: link `volt::mlflow`
/// (CMake) beside `volt::volt`; volt's other headers do not include this one.
///
/// \code
///   // MLFLOW_TRACKING_URI=http://127.0.0.1:5000 (or Options::tracking_uri)
///   auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>(
///       options, volt::CSVLogger{},
///       volt::MLFlowLogger({.experiment_name = "mnist", .log_model = volt::MLFlowLogger::LogModel::all}));
/// \endcode
///
/// - **The run**: created in `experiment_name` (the experiment made when missing) when a fit starts (a validate,
///   test or predict run: at its first event), on the global rank zero, tagged with `tags`, `mlflow.runName`,
///   `mlflow.user` and `mlflow.source.name`. Its id is kept in every checkpoint (`state_dict`), so a fit resumed from
///   one continues the same run (set back to RUNNING); `Options::run_id` names one instead. A checkpoint taken before
///   the server has answered the run's creation waits for the answer (at most the retries' bound). A fit and a later
///   test of one logger share the run.
/// - **Parameters**: the run's hyper-parameters (`Trainer::save_hyperparameters`, the configuration a program ran
///   with), flattened as Lightning's loggers do (`trainer/max_epochs`), each value as Python's `str` writes it (`5`,
///   `0.001`, `True`, `None`, a list as its JSON). MLflow keeps a parameter's first value: a resumed run that changes
///   one is told so in a warning, and its metrics still go.
/// - **Metrics**: every logging event, at its step, `epoch` among them, with `prefix` (`<prefix>-name`) as Lightning;
///   characters MLflow does not take in a name (other than letters, digits, `_ - . / space :`) are dropped, with a
///   warning naming the metric. NaN and infinities are sent as such. They are sent by a thread of the logger, at most
///   1000 in a request (the protocol's limit), so training does not wait on the server.
/// - **The end**: FINISHED, FAILED (an exception) or KILLED (a stop signal, the fit to be resumed), once everything
///   queued is sent (`finalize` waits for it).
/// - **Checkpoints** (`log_model`): `all` uploads each file a save writes (`checkpoints/<file name>`, a sharded
///   checkpoint's folder file by file) as it lands, hard-linked beside it then (`<name>.upload<n>.tmp.<pid>`, deleted
///   once sent), so that a file leaving the top k before its upload still goes; `at_end` uploads, when a fit finishes, the latest file of each
///   name that is still there (the top k and `last.ckpt`); through the server's artifact proxy (`mlflow server`
///   serves artifacts by default), or copied when the run's artifact location is a local folder (`file:`).
/// - **Failures do not stop training**: a server that cannot be reached, or keeps failing, through the retries of
///   volt/loggers/mlflow_client.hpp (bounded: 47.5 s a call with the defaults, at once when refused) is one warning,
///   after which the logger sends nothing more for the run; the other loggers go on. A call the server refuses (a bad
///   value) is a warning too, once per message, and the logger goes on.
/// - **Credentials** come from the environment as MLflow's client reads them (`MLFLOW_TRACKING_TOKEN`,
///   `MLFLOW_TRACKING_USERNAME`/`PASSWORD`, `MLFLOW_TRACKING_INSECURE_TLS`, `MLFLOW_TRACKING_SERVER_CERT_PATH`), and
///   never reach a message, a log, a checkpoint or the saved configuration. Writes nothing under fast_dev_run.

#include "volt/loggers/concept.hpp"
#include "volt/loggers/mlflow_client.hpp"
#include "volt/checkpoint.hpp"
#include "volt/stage.hpp"

#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace volt {

class MLFlowLogger {
 public:
  static constexpr bool is_logger = true;

  /// Which checkpoint files go to the run as artifacts (Lightning's `log_model`: False, True, "all").
  enum class LogModel { none, at_end, all };
  /// Its names in a configuration (volt/config/values.hpp): `none`, `at_end`, `all`.
  friend constexpr auto volt_enum_names(LogModel) {
    using P = std::pair<LogModel, std::string_view>;
    return std::array{P{LogModel::none, "none"}, P{LogModel::at_end, "at_end"}, P{LogModel::all, "all"}};
  }

  struct Options {
    /// The experiment the run goes to, made when the server has none of that name.
    std::string experiment_name = "volt_logs";
    /// The run's name (`mlflow.runName`); empty: the server picks one.
    std::string run_name;
    /// `http://host:port`; empty: `MLFLOW_TRACKING_URI`.
    std::string tracking_uri;
    /// Tags the run is created with.
    std::map<std::string, std::string> tags;
    LogModel log_model = LogModel::none;
    /// Put before each metric's name, with a `-` (`train-loss`), as Lightning's `prefix`.
    std::string prefix;
    /// Where a new experiment keeps its artifacts; empty: the server's choice.
    std::string artifact_location;
    /// Continue this run (over the id a resumed checkpoint holds); empty: the checkpoint's, else a new run.
    std::string run_id;
    /// Override the environment's (`MLFLOW_HTTP_REQUEST_TIMEOUT`, `MLFLOW_HTTP_REQUEST_MAX_RETRIES`) and the first
    /// wait between attempts; see volt/loggers/mlflow_client.hpp.
    std::optional<double> timeout_s;
    std::optional<int> max_retries;
    std::optional<double> backoff_s;
    /// A fit whose run cannot be opened (the server gives no answer, or refuses the credentials) fails as it starts,
    /// naming the server (as Lightning's logger does); true: that is one warning and the fit trains without MLflow.
    bool continue_without_server = false;
  };

  MLFlowLogger() : MLFlowLogger(Options{}) {}
  explicit MLFlowLogger(Options options) : options_(std::move(options)), shared_(std::make_shared<Shared>()) {
    mlflow::Connection c = mlflow::Connection::from_environment(options_.tracking_uri);
    if (options_.timeout_s) c.timeout_s = *options_.timeout_s;
    if (options_.max_retries) c.max_retries = *options_.max_retries;
    if (options_.backoff_s) c.backoff_s = *options_.backoff_s;
    c.check();  // a missing or unusable URI, before any training
    connection_ = std::move(c);
  }
  MLFlowLogger(MLFlowLogger&&) = default;
  MLFlowLogger& operator=(MLFlowLogger&&) = delete;
  ~MLFlowLogger() { stop(); }

  /// The run's id ("" before the run starts, or when the server could not be reached).
  std::string run_id() const {
    std::lock_guard lock(shared_->m);
    return shared_->run_id;
  }
  /// Whether the logger gave up on the server (after the one warning).
  bool gave_up() const { return shared_->broken; }

  template <class T, class M>
  void setup(T& trainer, M&, Stage) {
    shared_->enabled = trainer.is_global_zero() && !trainer.fast_dev_run();
  }

  /// A fit's run starts here, after a resumed checkpoint gave its id (so before any checkpoint of this fit); a
  /// validate, test or predict run's at its first event.
  template <class T, class M>
  void on_fit_start(T&, M&) {
    if (!shared_->enabled) return;
    start();
    if (options_.continue_without_server) return;
    std::string failure;
    {
      std::unique_lock lock(shared_->m);  // the run's creation answered (or the retries' bound passed)
      shared_->idle.wait(lock, [&] { return shared_->opened || shared_->broken; });
      failure = shared_->open_failure;
    }
    if (!failure.empty()) {
      throw ConfigError("volt: MLFlowLogger: the run could not be opened at " +
                        mlflow::Connection::redacted(connection_.tracking_uri) + " (" + failure + "), so the fit "
                        "does not start. Start the server or correct MLFLOW_TRACKING_URI, or set "
                        "MLFlowLogger::Options::continue_without_server = true to train without it.");
    }
  }

  void log_hyperparams(const Json& params) {
    if (!shared_->enabled) return;
    std::vector<Json> out;
    detail::for_each_hparam(params, [&](const std::string& name, const Json& v) {
      std::string value = v.is_string()    ? v.get<std::string>()
                          : v.is_boolean() ? (v.get<bool>() ? "True" : "False")
                          : v.is_null()    ? "None"
                                           : v.dump(-1, ' ', false, Json::error_handler_t::replace);
      if (value.size() > kMaxParamLength) {
        warn("parameter " + name + " is " + std::to_string(value.size()) + " bytes long; MLflow keeps " +
             std::to_string(kMaxParamLength) + ", so it is cut there");
        std::size_t n = kMaxParamLength;
        while (n > 0 && (static_cast<unsigned char>(value[n]) & 0xC0) == 0x80) --n;  // not inside a UTF-8 character
        value.resize(n);
      }
      out.push_back(Json{{"key", name}, {"value", std::move(value)}});
    });
    enqueue([&](Work& w) { w.params.insert(w.params.end(), out.begin(), out.end()); });
  }

  void log_metrics(const std::map<std::string, double>& metrics, int64_t step) {
    if (!shared_->enabled) return;
    start();
    const int64_t now = now_ms();
    std::vector<Json> out;
    out.reserve(metrics.size());
    for (const auto& [name, value] : metrics) {
      std::string key = metric_name(name);
      if (key.empty()) continue;
      out.push_back(Json{{"key", std::move(key)}, {"value", number(value)}, {"timestamp", now}, {"step", step}});
    }
    enqueue([&](Work& w) { w.metrics.insert(w.metrics.end(), out.begin(), out.end()); });
  }

  /// Wakes the sender (it sends as values come; `finalize` waits for it).
  void flush() {
    if (!shared_->enabled) return;
    start();
    shared_->wake.notify_all();
  }

  /// Each file a checkpoint save wrote (the Trainer calls it once every file is in place; on the writer's thread for
  /// asynchronous saves).
  /// A save outside a run (after a fit) goes to the run as it stands, its status unchanged; none before a run.
  void after_save_checkpoint(const std::vector<std::string>& files) {
    if (!shared_->enabled || options_.log_model == LogModel::none) return;
    {
      std::lock_guard guard(shared_->start);
      if (!shared_->started) return;
    }
    if (options_.log_model == LogModel::all) {
      std::vector<Upload> staged;  // linked before the save returns: a file leaving the top k cannot take it first
      for (const auto& f : files) {
        if (auto u = stage(f, shared_->staged++)) staged.push_back(std::move(*u));
      }
      enqueue([&](Work& w) { w.uploads.insert(w.uploads.end(), staged.begin(), staged.end()); });
    } else {
      std::lock_guard lock(shared_->m);
      for (const auto& f : files) shared_->at_end[std::filesystem::path(f).filename().string()] = f;
    }
  }

  /// Ends the run with its status once everything queued is sent.
  void finalize(RunStatus status) {
    if (!shared_->enabled) return;
    start();
    std::vector<Upload> uploads;
    if (status == RunStatus::finished && options_.log_model == LogModel::at_end) {
      std::lock_guard lock(shared_->m);
      for (const auto& [name, file] : shared_->at_end) uploads.push_back({file, name, nullptr});
      shared_->at_end.clear();
    }
    enqueue([&](Work& w) {
      w.uploads.insert(w.uploads.end(), uploads.begin(), uploads.end());
      w.end = status;
    });
    drain();
    std::lock_guard guard(shared_->start);
    shared_->ended = true;
  }

  /// The run id, for a resumed fit to continue the run (waiting for the server's answer when the run is being
  /// opened), and under `at_end` the files to upload when the fit finishes.
  checkpoint::Dict state_dict() const {
    checkpoint::Dict d = checkpoint::make_dict();
    d.insert("run_id", opened_run_id());
    checkpoint::Dict files = checkpoint::make_dict();
    std::lock_guard lock(shared_->m);
    for (const auto& [name, path] : shared_->at_end) files.insert(name, path);
    d.insert("at_end", files);
    return d;
  }
  void load_state_dict(const checkpoint::Dict& d) {
    std::lock_guard guard(shared_->start);
    if (shared_->started) return;
    if (d.contains("run_id") && options_.run_id.empty()) resumed_run_id_ = d.at("run_id").toStringRef();
    std::lock_guard lock(shared_->m);
    shared_->at_end.clear();
    if (d.contains("at_end")) {
      for (const auto& e : d.at("at_end").toGenericDict())
        shared_->at_end[e.key().toStringRef()] = e.value().toStringRef();
    }
  }

 private:
  static constexpr std::size_t kMaxParamLength = 6000;  // MLflow's MAX_PARAM_VAL_LENGTH
  static constexpr std::size_t kMaxKeyLength = 250;     // MLflow's MAX_ENTITY_KEY_LENGTH
  static constexpr std::size_t kMaxBatch = 1000;        // entities in one log-batch request
  static constexpr std::size_t kMaxParamsBatch = 100;   // parameters in one

  /// A checkpoint file (or a sharded checkpoint's folder) hard-linked beside it as its save landed (`stage`), so that
  /// the checkpoint leaving the top k cannot delete it before its upload; deleted once the last upload holding it is
  /// done or dropped.
  struct Staged {
    std::filesystem::path path;
    Staged() = default;
    Staged(const Staged&) = delete;
    Staged& operator=(const Staged&) = delete;
    ~Staged() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  /// What an upload reads (`path`, a file or a folder) and sends as `checkpoints/<name>`.
  struct Upload {
    std::filesystem::path path;
    std::string name;
    std::shared_ptr<const Staged> staged;
  };
  struct Work {
    std::vector<Json> params, metrics;
    std::vector<Upload> uploads;
    std::optional<RunStatus> end;
    bool resume = false;  // set the run back to RUNNING first
    bool empty() const { return params.empty() && metrics.empty() && uploads.empty() && !end && !resume; }
  };
  /// What the training thread and the sender share (behind a pointer: the logger moves).
  struct Shared {
    std::mutex m, start;
    std::condition_variable wake, idle;
    Work queue;
    bool busy = false, stopping = false, opened = false;
    std::atomic<bool> enabled{false};           // set by setup; read on the checkpoint writer's thread too
    bool started = false, ended = false;        // under `start`
    std::map<std::string, std::string> at_end;  // file name -> its latest path (log_model = at_end)
    std::string run_id, artifact_uri;
    std::atomic<bool> broken{false};
    std::string open_failure;  // why the run could not be opened (unless continue_without_server)
    std::atomic<uint64_t> staged{0};  // uploads staged so far (each its own name)
    std::set<std::string> said;  // warnings given, each once
  };

  /// `file` staged for its upload: each of its files hard-linked (copied where the file system cannot link) into
  /// `<file>.upload<n>.tmp.<pid>` beside it, a temporary's name that no reader takes for a checkpoint and that the
  /// folder's next save deletes when a killed job left it. The file itself, unstaged, where that fails; none where it
  /// is gone.
  static std::optional<Upload> stage(const std::string& file, uint64_t n) {
    namespace fs = std::filesystem;
    const fs::path from(file);
    std::error_code ec;
    if (!fs::exists(from, ec)) return std::nullopt;
    auto staged = std::make_shared<Staged>();
    staged->path = from.parent_path() / (from.filename().string() + ".upload" + std::to_string(n) + ".tmp." +
                                         std::to_string(::getpid()));
    const auto place = [&](const fs::path& a, const fs::path& b) {
      fs::create_hard_link(a, b, ec);
      if (ec) {
        ec.clear();
        fs::copy_file(a, b, fs::copy_options::overwrite_existing, ec);
      }
      return !ec;
    };
    bool ok = true;
    if (fs::is_directory(from, ec)) {
      fs::create_directories(staged->path, ec);
      ok = !ec;
      for (auto it = fs::recursive_directory_iterator(from, ec); ok && !ec && it != fs::recursive_directory_iterator();
           it.increment(ec)) {
        const fs::path to = staged->path / it->path().lexically_relative(from);
        if (it->is_directory(ec)) {
          fs::create_directories(to, ec);
          ok = !ec;
        } else if (it->is_regular_file(ec)) {
          ok = place(it->path(), to);
        }
      }
      ok = ok && !ec;
    } else {
      ok = place(from, staged->path);
    }
    if (!ok) return Upload{from, from.filename().string(), nullptr};  // (what was staged goes with `staged`)
    return Upload{staged->path, from.filename().string(), std::move(staged)};
  }

  /// Up to `n` items of `v` from `i`, as a JSON array.
  static Json slice(const std::vector<Json>& v, std::size_t i, std::size_t n) {
    Json out = Json::array();
    for (std::size_t k = i; k < v.size() && k < i + n; ++k) out.push_back(v[k]);
    return out;
  }
  static int64_t now_ms() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
  /// A double as protobuf's JSON writes one: non-finite values as strings.
  static Json number(double v) {
    if (std::isnan(v)) return "NaN";
    if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
    return v;
  }
  std::string metric_name(const std::string& name) {
    std::string out = options_.prefix.empty() ? name : options_.prefix + "-" + name;
    std::string kept;
    for (char ch : out) {
      if (std::isalnum(static_cast<unsigned char>(ch)) ||
          std::string_view("_-./ :").find(ch) != std::string_view::npos) {
        kept += ch;
      }
    }
    if (kept != out) {
      warn("metric \"" + out + "\" has characters MLflow does not take in a name; " +
           (kept.empty() ? std::string("it is not sent") : "sent as \"" + kept + "\""));
    }
    if (kept.size() > kMaxKeyLength) {
      warn("metric \"" + kept + "\" is longer than MLflow's " + std::to_string(kMaxKeyLength) +
           " characters; cut there");
      kept.resize(kMaxKeyLength);
    }
    return kept;
  }
  void warn(const std::string& what) const { note(*shared_, what); }

  template <class F>
  void enqueue(F&& add) {
    {
      std::lock_guard lock(shared_->m);
      if (shared_->broken) return;
      add(shared_->queue);
    }
    shared_->wake.notify_all();
  }
  void drain() {
    std::unique_lock lock(shared_->m);
    shared_->idle.wait(lock, [&] { return (shared_->queue.empty() && !shared_->busy) || !sender_.joinable(); });
  }
  std::string opened_run_id() const {
    bool started = false;
    {
      std::lock_guard guard(shared_->start);
      started = shared_->started;
    }
    std::unique_lock lock(shared_->m);
    if (shared_->enabled && started) shared_->idle.wait(lock, [&] { return shared_->opened || shared_->broken; });
    return shared_->run_id;
  }
  void stop() {
    if (!shared_ || !sender_.joinable()) return;
    {
      std::lock_guard lock(shared_->m);
      shared_->stopping = true;
    }
    shared_->wake.notify_all();
    sender_.join();
  }

  /// The run starts (or a finished one of this logger goes on) on the first event after a restore could give it an
  /// id; the sender thread starts with it.
  void start() {
    std::lock_guard guard(shared_->start);
    if (shared_->ended) {
      shared_->ended = false;
      enqueue([](Work& w) { w.resume = true; });
    }
    if (shared_->started) return;
    std::string id = options_.run_id.empty() ? resumed_run_id_ : options_.run_id;
    sender_ =
        std::thread([shared = shared_, c = connection_, o = options_, id]() mutable { send_loop(*shared, c, o, id); });
    shared_->started = true;
  }

  static void send_loop(Shared& s, const mlflow::Connection& c, const Options& o, const std::string& id);
  static void open_run(Shared& s, mlflow::Client& client, const Options& o, const std::string& id);
  static void send(Shared& s, mlflow::Client& client, Work& w);
  static void upload(Shared& s, mlflow::Client& client, const Upload& u);
  static void note(Shared& s, const std::string& what) {
    std::lock_guard lock(s.m);
    if (s.said.insert(what).second) {
      std::cerr << "volt: MLFlowLogger: " << what << (what.empty() || what.back() != '.' ? ".\n" : "\n");
    }
  }

  Options options_;
  mlflow::Connection connection_;
  std::shared_ptr<Shared> shared_;
  std::thread sender_;
  std::string resumed_run_id_;
};

/// The sender: opens the run, then sends what is queued until the logger stops. A server that cannot be reached is
/// one warning, after which the queue is dropped and nothing more is sent.
inline void MLFlowLogger::send_loop(Shared& s, const mlflow::Connection& c, const Options& o, const std::string& id) {
  std::optional<mlflow::Client> client;
  bool opened = false;
  for (;;) {
    Work w;
    {
      std::unique_lock lock(s.m);
      s.wake.wait(lock, [&] { return s.stopping || !s.queue.empty() || !opened; });
      if (s.stopping && (s.queue.empty() || s.broken)) break;
      w = std::exchange(s.queue, Work{});
      s.busy = true;
    }
    try {
      if (!client) client.emplace(c);
      if (!opened) open_run(s, *client, o, id);
      opened = true;
      send(s, *client, w);
    } catch (const mlflow::Unreachable& e) {
      if (opened || o.continue_without_server) {
        note(s, std::string("the tracking server gave no answer, so nothing more of this run goes to MLflow (the "
                            "other loggers go on): ") +
                    e.what());
      }
      std::lock_guard lock(s.m);
      if (!opened && !o.continue_without_server) s.open_failure = std::string("no answer: ") + e.what();
      s.broken = true;
      s.queue = Work{};
      opened = true;
    } catch (const std::exception& e) {
      if (opened || o.continue_without_server) note(s, e.what());
      if (!opened) {  // no run to log to (credentials refused, say): nothing more is sent
        std::lock_guard lock(s.m);
        if (!o.continue_without_server) s.open_failure = e.what();
        s.broken = true;
        s.queue = Work{};
      }
      opened = true;
    }
    {
      std::lock_guard lock(s.m);
      s.busy = false;
      s.opened = opened;
    }
    s.idle.notify_all();
  }
  s.idle.notify_all();
}

/// The run to log to: `id` when the server has it (set RUNNING again), else a new one in the experiment.
inline void MLFlowLogger::open_run(Shared& s, mlflow::Client& client, const Options& o, const std::string& id) {
  if (!id.empty()) {
    try {
      const Json run = client.get("runs/get", "run_id=" + client.escape(id));
      client.post("runs/update", {{"run_id", id}, {"status", "RUNNING"}});
      std::lock_guard lock(s.m);
      s.run_id = id;
      s.artifact_uri = run.at("run").at("info").value("artifact_uri", std::string());
      return;
    } catch (const mlflow::Rejected& e) {
      note(s, "run " + id + " could not be continued (" + e.what() + "); a new run starts");
    }
  }
  auto find = [&] {
    const std::string query = "experiment_name=" + client.escape(o.experiment_name);
    return client.get("experiments/get-by-name", query).at("experiment").at("experiment_id").get<std::string>();
  };
  std::string experiment;
  try {
    experiment = find();
  } catch (const mlflow::Rejected& e) {
    if (e.status != 404) throw;
    Json body = {{"name", o.experiment_name}};
    if (!o.artifact_location.empty()) body["artifact_location"] = o.artifact_location;
    try {
      experiment = client.post("experiments/create", body).at("experiment_id").get<std::string>();
    } catch (const mlflow::Rejected&) {
      experiment = find();  // made meanwhile (another run, or a retried create that had gone through)
    }
  }
  Json tags = Json::array();
  auto tag = [&](const std::string& k, const std::string& v) { tags.push_back({{"key", k}, {"value", v}}); };
  for (const auto& [k, v] : o.tags) tag(k, v);
  if (!o.run_name.empty()) tag("mlflow.runName", o.run_name);
  if (const char* user = std::getenv("USER")) tag("mlflow.user", user);
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) tag("mlflow.source.name", exe.string());
  tag("mlflow.source.type", "LOCAL");
  Json body = {{"experiment_id", experiment}, {"start_time", now_ms()}, {"tags", tags}};
  if (!o.run_name.empty()) body["run_name"] = o.run_name;
  const Json run = client.post("runs/create", body);
  std::lock_guard lock(s.m);
  s.run_id = run.at("run").at("info").at("run_id").get<std::string>();
  s.artifact_uri = run.at("run").at("info").value("artifact_uri", std::string());
}

/// One piece of queued work: parameters (100 a request, apart from metrics so that a refused parameter loses no
/// metric), metrics (1000 a request), uploads, then the run's status.
inline void MLFlowLogger::send(Shared& s, mlflow::Client& client, Work& w) {
  std::string id;
  {
    std::lock_guard lock(s.m);
    id = s.run_id;
  }
  if (w.resume) client.post("runs/update", {{"run_id", id}, {"status", "RUNNING"}});
  for (std::size_t i = 0; i < w.params.size(); i += kMaxParamsBatch) {
    try {
      client.post("runs/log-batch", {{"run_id", id}, {"params", slice(w.params, i, kMaxParamsBatch)}});
    } catch (const mlflow::Rejected& e) {
      note(s, std::string("the server kept earlier parameters (a resumed run changed one?): ") + e.what());
    }
  }
  for (std::size_t i = 0; i < w.metrics.size(); i += kMaxBatch) {
    try {
      client.post("runs/log-batch", {{"run_id", id}, {"metrics", slice(w.metrics, i, kMaxBatch)}});
    } catch (const mlflow::Rejected& e) {
      note(s, std::string("metrics refused: ") + e.what());
    }
  }
  for (const Upload& u : w.uploads) {
    try {
      upload(s, client, u);
    } catch (const mlflow::Unreachable&) {
      throw;
    } catch (const std::exception& e) {
      note(s, "checkpoint " + u.name + " not uploaded: " + e.what());
    }
  }
  if (w.end) {
    const char* status = *w.end == RunStatus::finished ? "FINISHED" : *w.end == RunStatus::failed ? "FAILED" : "KILLED";
    client.post("runs/update", {{"run_id", id}, {"status", status}, {"end_time", now_ms()}});
  }
}

/// A checkpoint file (or a sharded checkpoint's folder, file by file) to `checkpoints/` among the run's artifacts.
inline void MLFlowLogger::upload(Shared& s, mlflow::Client& client, const Upload& u) {
  std::string uri;
  {
    std::lock_guard lock(s.m);
    uri = s.artifact_uri;
  }
  const std::filesystem::path& root = u.path;
  std::vector<std::pair<std::filesystem::path, std::string>> files;  // each file and its artifact path
  std::error_code ec;
  if (std::filesystem::is_directory(root, ec)) {
    for (auto it = std::filesystem::recursive_directory_iterator(root, ec);
         !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
      const auto& e = *it;
      if (e.is_regular_file(ec)) {
        files.emplace_back(e.path(), "checkpoints/" + (std::filesystem::path(u.name) / e.path().lexically_relative(root)).string());
      }
    }
  } else if (std::filesystem::is_regular_file(root, ec)) {
    files.emplace_back(root, "checkpoints/" + u.name);
  } else if (u.staged) {
    throw std::runtime_error("its staged copy is gone");
  } else {
    return;  // at_end: a file that left the top k (deleted) is not sent
  }
  const std::string proxy = "mlflow-artifacts:";
  for (const auto& [path, name] : files) {
    if (uri.rfind(proxy, 0) == 0) {
      std::string rest = uri.substr(proxy.size());
      if (rest.rfind("//", 0) == 0)
        rest = rest.substr(rest.find('/', 2) == std::string::npos ? rest.size() : rest.find('/', 2));
      while (!rest.empty() && rest.front() == '/') rest.erase(0, 1);
      std::string escaped;  // each part of the name percent-encoded (a space, '#', '%')
      for (const auto& part : std::filesystem::path(name)) {
        escaped += '/';  // appended piece by piece: GCC 12 warns falsely on `"/" + std::string` here
        escaped += client.escape(part.string());
      }
      client.upload(rest + escaped, path);
    } else if (uri.rfind("file:", 0) == 0 || (!uri.empty() && uri.front() == '/')) {
      std::string dir = uri.rfind("file://", 0) == 0 ? uri.substr(7) : uri.rfind("file:", 0) == 0 ? uri.substr(5) : uri;
      const std::filesystem::path to = std::filesystem::path(dir) / name;
      std::filesystem::create_directories(to.parent_path());
      std::filesystem::copy_file(path, to, std::filesystem::copy_options::overwrite_existing);
    } else {
      note(s, "the run's artifacts are at " + uri +
                  ", which volt cannot write to; serve them through the tracking "
                  "server (`mlflow server --serve-artifacts`, its default) to log checkpoints");
      return;
    }
  }
}

}  // namespace volt
