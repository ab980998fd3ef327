// expect: error: [^ ]*volt::TrainerOptions[^ ]* has no non-static data member named [^ ]*max_epoch
// A misspelt option in the README's spelling (the options' type named): one line that names the field.
#include <volt/volt.hpp>
int main() {
  volt::Trainer<volt::SingleDevice, volt::Fp32, volt::CPU, volt::ProgressBar> trainer(
      volt::TrainerOptions{.max_epoch = 5, .gradient_clip_val = 1.0}, volt::ProgressBar{});
}
