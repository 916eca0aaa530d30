// tensorstash: list, inspect, verify and convert checkpoints (cli/run.h).
#include "run.h"

int main(int argc, char** argv) { return tensorstash::cli::Run(argc, argv); }
