// expect: field_missing_from_table<Options, [^ ]*"depth"
// A field of a configurable struct left out of its table (a field added to the struct later): one error that names it.
#include <volt/volt.hpp>
struct Options {
  int64_t width = 8;
  int64_t depth = 2;
  double lr = 0.1;
};
constexpr auto volt_fields(const Options*) { return volt::fields({{"width", "hidden units"}, {"lr", "learning rate"}}); }
int main(int argc, char** argv) {
  Options options;
  volt::Config config;
  config.add("model", options);
  return config.parse(argc, argv) ? 0 : 1;
}
