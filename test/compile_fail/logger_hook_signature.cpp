// expect: a logger's finalize has a signature volt does not call
#include <volt/volt.hpp>
// finalize takes a volt::RunStatus, not Lightning's status string: volt would never call this one.
struct StatusLogger {
  void log_metrics(const std::map<std::string, double>&, int64_t) {}
  void finalize(const std::string& status) {}
};
int main() {
  volt::Trainer<volt::SingleDevice, volt::Fp32, volt::CPU, StatusLogger> trainer({}, StatusLogger{});
}
