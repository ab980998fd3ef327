// expect: error: [^ ]*volt::data::LoaderOptions[^ ]* has no non-static data member named [^ ]*batchsize
// A misspelt loader option in the README's spelling (the options' type named): one line that names the field.
#include <volt/volt.hpp>
int main() {
  auto x = torch::rand({8, 4}), y = torch::rand({8, 1});
  volt::data::TensorLoader train(x, y, volt::data::LoaderOptions{.batchsize = 4, .shuffle = true});
}
