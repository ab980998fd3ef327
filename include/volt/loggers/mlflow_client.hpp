#pragma once
/// \file
/// MLflow's tracking REST protocol (`/api/2.0/mlflow/...`, and the artifact proxy `/api/2.0/mlflow-artifacts/...`) over
/// libcurl: the calls volt::MLFlowLogger makes, with the connection settings MLflow's own Python client reads from the
/// environment, bounded retries, and credentials kept out of every message. Needs libcurl: link `volt::mlflow`
/// (CMake), which brings it; the rest of volt does not include this header.
///
/// Retries as MLflow's client: a request that fails in transport (refused, reset, timed out) or answers 429, 500, 502,
/// 503 or 504 is tried again after `backoff_s`, then twice that, up to `max_retries` more times; each attempt ends
/// after `timeout_s`. So one call gives up after at most `(max_retries + 1) * timeout_s + backoff_s * (2^max_retries -
/// 1)` seconds: 47.5 s with the defaults below (10 s, 3 retries, 0.5 s), at once when the connection is refused.

#include "volt/config/values.hpp"
#include "volt/errors.hpp"

#include <curl/curl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

namespace volt::mlflow {

/// Where the server is and how to reach it; `from_environment` reads what MLflow's client reads.
struct Connection {
  /// `http://host:port` or `https://...` (a path after it is kept: a server behind a prefix).
  std::string tracking_uri;
  /// `MLFLOW_TRACKING_TOKEN`: sent as `Authorization: Bearer <token>`.
  std::string token;
  /// `MLFLOW_TRACKING_USERNAME` and `MLFLOW_TRACKING_PASSWORD`: HTTP basic authentication.
  std::string username, password;
  /// `MLFLOW_TRACKING_INSECURE_TLS=true`: do not verify the server's certificate.
  bool insecure_tls = false;
  /// `MLFLOW_TRACKING_SERVER_CERT_PATH`: a CA bundle to verify it with.
  std::string server_cert_path;
  /// `MLFLOW_HTTP_REQUEST_TIMEOUT`: seconds one attempt may take (MLflow's own default is 120; a training run should
  /// not wait that long on a logger).
  double timeout_s = 10;
  /// `MLFLOW_HTTP_REQUEST_MAX_RETRIES`: attempts after the first.
  int max_retries = 3;
  /// Seconds before the first retry, doubled before each next one.
  double backoff_s = 0.5;

  /// The settings from the environment; `tracking_uri` non-empty overrides `MLFLOW_TRACKING_URI`.
  static Connection from_environment(const std::string& tracking_uri = "") {
    auto env = [](const char* name) {
      const char* v = std::getenv(name);
      return std::string(v ? v : "");
    };
    Connection c;
    c.tracking_uri = tracking_uri.empty() ? env("MLFLOW_TRACKING_URI") : tracking_uri;
    c.token = env("MLFLOW_TRACKING_TOKEN");
    c.username = env("MLFLOW_TRACKING_USERNAME");
    c.password = env("MLFLOW_TRACKING_PASSWORD");
    const std::string insecure = env("MLFLOW_TRACKING_INSECURE_TLS");
    c.insecure_tls = insecure == "true" || insecure == "True" || insecure == "1";
    c.server_cert_path = env("MLFLOW_TRACKING_SERVER_CERT_PATH");
    if (const std::string t = env("MLFLOW_HTTP_REQUEST_TIMEOUT"); !t.empty())
      c.timeout_s = number(t, "MLFLOW_HTTP_REQUEST_TIMEOUT");
    if (const std::string r = env("MLFLOW_HTTP_REQUEST_MAX_RETRIES"); !r.empty()) {
      c.max_retries = static_cast<int>(number(r, "MLFLOW_HTTP_REQUEST_MAX_RETRIES"));
    }
    return c;
  }

  /// Refuses what cannot work, naming it: no URI, a scheme other than http(s), a negative bound.
  void check() const {
    if (tracking_uri.empty()) {
      throw ConfigError(
          "volt: MLFlowLogger has no tracking URI: give Options::tracking_uri or set MLFLOW_TRACKING_URI "
          "to the server's http://host:port (`mlflow server --host 127.0.0.1 --port 5000` starts one).");
    }
    if (tracking_uri.rfind("http://", 0) != 0 && tracking_uri.rfind("https://", 0) != 0) {
      throw ConfigError("volt: MLFlowLogger's tracking URI \"" + redacted(tracking_uri) +
                        "\" is not allowed: volt "
                        "speaks MLflow's REST protocol to a tracking server, so give http://host:port or https://...; "
                        "a local folder or database needs one (`mlflow server --backend-store-uri ...`).");
    }
    if (!(timeout_s > 0) || max_retries < 0 || !(backoff_s >= 0)) {
      throw ConfigError("volt: MLFlowLogger timeout_s=" + std::to_string(timeout_s) +
                        ", max_retries=" + std::to_string(max_retries) + ", backoff_s=" + std::to_string(backoff_s) +
                        " are not allowed: give timeout_s > 0, max_retries >= 0, backoff_s >= 0.");
    }
  }

  /// The URI without a `user:password@` part (with or without a scheme; a password may hold '@'), for messages.
  static std::string redacted(const std::string& uri) {
    const auto scheme = uri.find("://");
    const std::size_t from = scheme == std::string::npos ? 0 : scheme + 3;
    const auto slash = uri.find('/', from);
    const auto at = uri.rfind('@', slash == std::string::npos ? std::string::npos : slash);
    if (at == std::string::npos || at < from) return uri;
    return uri.substr(0, from) + "***@" + uri.substr(at + 1);
  }

 private:
  static double number(const std::string& s, const char* name) {
    try {
      std::size_t used = 0;
      const double v = std::stod(s, &used);
      if (used == s.size()) return v;
    } catch (const std::exception&) {
    }
    throw ConfigError(std::string("volt: ") + name + "=\"" + s + "\" is not a number.");
  }
};

/// The server could not be reached, or kept failing, through every retry.
struct Unreachable : std::runtime_error {
  using std::runtime_error::runtime_error;
};
/// The server answered a call with an error that retrying does not mend (400: a bad value, 401/403: credentials, 404).
struct Rejected : std::runtime_error {
  Rejected(long status, const std::string& what) : std::runtime_error(what), status(status) {}
  long status;
};

/// One connection to a tracking server (a libcurl easy handle, reused: one TCP connection kept alive). Not thread-safe:
/// one thread calls it at a time.
class Client {
 public:
  explicit Client(Connection c) : c_(std::move(c)) {
    c_.check();
    static std::once_flag once;
    std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
    curl_ = curl_easy_init();
    if (curl_ == nullptr) throw std::runtime_error("volt: MLFlowLogger: libcurl could not make a handle.");
    while (!c_.tracking_uri.empty() && c_.tracking_uri.back() == '/') c_.tracking_uri.pop_back();
  }
  ~Client() { curl_easy_cleanup(curl_); }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const Connection& connection() const { return c_; }

  /// `POST /api/2.0/mlflow/<endpoint>` with a JSON body; the answer's JSON. Retries as the file's comment says.
  Json post(const std::string& endpoint, const Json& body) {
    return Json::parse(retried("POST", "/api/2.0/mlflow/" + endpoint, dump(body), nullptr));
  }
  /// `GET /api/2.0/mlflow/<endpoint>?<query>` (the query's values already escaped: `escape`).
  Json get(const std::string& endpoint, const std::string& query) {
    return Json::parse(retried("GET", "/api/2.0/mlflow/" + endpoint + "?" + query, "", nullptr));
  }
  /// `PUT /api/2.0/mlflow-artifacts/artifacts/<path>` (its parts escaped) with a file's bytes, streamed from the file
  /// opened once (a file renamed over meanwhile, as `last.ckpt` is, still sends the bytes it had). A file that is gone
  /// is passed over (false). An upload has no overall time limit: it fails when no byte moves for `timeout_s`.
  bool upload(const std::string& path, const std::filesystem::path& file) {
    std::unique_ptr<std::FILE, decltype(&std::fclose)> in(std::fopen(file.c_str(), "rb"), &std::fclose);
    if (!in) {
      if (errno == ENOENT) return false;
      throw Rejected(0, "cannot read " + file.string() + ": " + std::strerror(errno));
    }
    retried("PUT", "/api/2.0/mlflow-artifacts/artifacts/" + path, "", in.get());
    return true;
  }

  /// A URL query value or path part, percent-encoded.
  std::string escape(const std::string& s) {
    char* e = curl_easy_escape(curl_, s.c_str(), static_cast<int>(s.size()));
    std::string out(e ? e : "");
    curl_free(e);
    return out;
  }

 private:
  struct Answer {
    CURLcode code = CURLE_OK;
    long status = 0;
    std::string body;
    std::string error;
  };

  /// JSON text, invalid UTF-8 in a string replaced rather than thrown on.
  static std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

  /// Failures of the network (worth another attempt), as against a malformed URL or a TLS setting.
  static bool network_failure(CURLcode code) {
    switch (code) {
      case CURLE_COULDNT_RESOLVE_PROXY:
      case CURLE_COULDNT_RESOLVE_HOST:
      case CURLE_COULDNT_CONNECT:
      case CURLE_OPERATION_TIMEDOUT:
      case CURLE_SEND_ERROR:
      case CURLE_RECV_ERROR:
      case CURLE_GOT_NOTHING:
      case CURLE_PARTIAL_FILE:
      case CURLE_HTTP2:
      case CURLE_HTTP2_STREAM: return true;
      default: return false;
    }
  }

  std::string retried(const char* method, const std::string& path, const std::string& body, std::FILE* file) {
    double wait = c_.backoff_s;
    for (int attempt = 0;; ++attempt) {
      if (file != nullptr) std::rewind(file);
      Answer a = once(method, path, body, file);
      if (a.code == CURLE_OK && a.status >= 200 && a.status < 300) return a.body.empty() ? "{}" : a.body;
      const bool transient = (a.code != CURLE_OK && network_failure(a.code)) || a.status == 429 || a.status == 500 ||
                             a.status == 502 || a.status == 503 || a.status == 504;
      const std::string what =
          std::string(method) + " " + path + " at " + Connection::redacted(c_.tracking_uri) + ": " +
          (a.code != CURLE_OK ? a.error : "HTTP " + std::to_string(a.status) + " " + server_message(a.body));
      if (!transient) throw Rejected(a.status, what);
      if (attempt >= c_.max_retries) {
        throw Unreachable(what + " (" + std::to_string(attempt + 1) + " attempts)");
      }
      std::this_thread::sleep_for(std::chrono::duration<double>(wait));
      wait *= 2;
    }
  }

  /// MLflow's `{"error_code": ..., "message": ...}`, or the body's start as one line: an HTML page (a wrong path's
  /// 404) without its tags, every run of white space one space, at most 200 characters.
  static std::string server_message(const std::string& body) {
    const Json j = Json::parse(body, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("message") && j["message"].is_string()) {
      return (j.contains("error_code") ? j["error_code"].get<std::string>() + ": " : std::string()) +
             j["message"].get<std::string>();
    }
    std::string line;
    bool in_tag = false;
    for (const char c : body) {
      if (c == '<') in_tag = true;
      const bool space = in_tag || std::isspace(static_cast<unsigned char>(c));
      if (c == '>') in_tag = false;
      if (space) {
        if (!line.empty() && line.back() != ' ') line += ' ';
      } else {
        line += c;
      }
      if (line.size() >= 200) break;
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    return line;
  }

  static std::size_t collect(char* data, std::size_t size, std::size_t n, void* out) {
    static_cast<std::string*>(out)->append(data, size * n);
    return size * n;
  }

  Answer once(const char* method, const std::string& path, const std::string& body, std::FILE* file) {
    Answer a;
    curl_easy_reset(curl_);
    const std::string url = c_.tracking_uri + path;
    curl_easy_setopt(curl_, CURLOPT_URL, url.c_str());
    curl_easy_setopt(curl_, CURLOPT_NOSIGNAL, 1L);  // timeouts without SIGALRM: the logger runs on its own thread
    curl_easy_setopt(curl_, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(c_.timeout_s * 1000));
    if (file == nullptr) {
      curl_easy_setopt(curl_, CURLOPT_TIMEOUT_MS, static_cast<long>(c_.timeout_s * 1000));
    } else {  // a large file takes its time: the limit is on a transfer that stalls
      curl_easy_setopt(curl_, CURLOPT_LOW_SPEED_LIMIT, 1L);
      curl_easy_setopt(curl_, CURLOPT_LOW_SPEED_TIME, std::max(1L, static_cast<long>(c_.timeout_s)));
    }
    curl_easy_setopt(curl_, CURLOPT_WRITEFUNCTION, &Client::collect);
    curl_easy_setopt(curl_, CURLOPT_WRITEDATA, &a.body);
    char error[CURL_ERROR_SIZE] = {0};
    curl_easy_setopt(curl_, CURLOPT_ERRORBUFFER, error);
    if (!c_.username.empty() || !c_.password.empty()) {
      curl_easy_setopt(curl_, CURLOPT_HTTPAUTH, CURLAUTH_BASIC);
      curl_easy_setopt(curl_, CURLOPT_USERNAME, c_.username.c_str());
      curl_easy_setopt(curl_, CURLOPT_PASSWORD, c_.password.c_str());
    }
    if (c_.insecure_tls) {
      curl_easy_setopt(curl_, CURLOPT_SSL_VERIFYPEER, 0L);
      curl_easy_setopt(curl_, CURLOPT_SSL_VERIFYHOST, 0L);
    }
    if (!c_.server_cert_path.empty()) curl_easy_setopt(curl_, CURLOPT_CAINFO, c_.server_cert_path.c_str());
    std::unique_ptr<curl_slist, decltype(&curl_slist_free_all)> headers(nullptr, &curl_slist_free_all);
    auto add = [&](const std::string& h) { headers.reset(curl_slist_append(headers.release(), h.c_str())); };
    if (!c_.token.empty()) add("Authorization: Bearer " + c_.token);
    if (file != nullptr) {
      struct stat st {};
      if (::fstat(::fileno(file), &st) != 0)
        throw Rejected(0, std::string("cannot size a file: ") + std::strerror(errno));
      add("Content-Type: application/octet-stream");
      curl_easy_setopt(curl_, CURLOPT_UPLOAD, 1L);
      curl_easy_setopt(curl_, CURLOPT_READDATA, file);
      curl_easy_setopt(curl_, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(st.st_size));
    } else if (std::string(method) == "POST") {
      add("Content-Type: application/json");
      curl_easy_setopt(curl_, CURLOPT_POSTFIELDS, body.c_str());
      curl_easy_setopt(curl_, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body.size()));
    }
    curl_easy_setopt(curl_, CURLOPT_HTTPHEADER, headers.get());
    a.code = curl_easy_perform(curl_);
    if (a.code != CURLE_OK) a.error = error[0] ? error : curl_easy_strerror(a.code);
    curl_easy_getinfo(curl_, CURLINFO_RESPONSE_CODE, &a.status);
    curl_easy_setopt(curl_, CURLOPT_ERRORBUFFER, nullptr);
    return a;
  }

  Connection c_;
  CURL* curl_ = nullptr;
};

}  // namespace volt::mlflow
