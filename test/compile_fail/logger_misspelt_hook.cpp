// expect: a logger has no log_metrics: it needs
#include <volt/volt.hpp>
// A logger whose one required hook is misspelt: without the check it would be a callback that never logs.
struct JsonLinesLogger {
  static constexpr bool is_logger = true;
  void log_metric(const std::map<std::string, double>&, int64_t) {}  // log_metrics
};
int main() {
  volt::Trainer<volt::SingleDevice, volt::Fp32, volt::CPU, JsonLinesLogger> trainer({}, JsonLinesLogger{});
}
