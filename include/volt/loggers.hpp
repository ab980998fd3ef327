#pragma once
/// \file Loggers (volt/loggers/concept.hpp): CSVLogger and TensorBoardLogger, and the concept a program's own meets.
#include "volt/loggers/concept.hpp"
#include "volt/loggers/csv.hpp"
#include "volt/loggers/tensorboard.hpp"
