// tensorstash: list, inspect, verify and convert checkpoints.
#include <CLI/CLI.hpp>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"tensorstash: inspect, verify and convert tensorstash checkpoints"};
  app.require_subcommand(1);
  int exit_code = 0;
  tensorstash::cli::AddLsCommand(app, &exit_code);
  tensorstash::cli::AddInspectCommand(app, &exit_code);
  tensorstash::cli::AddVerifyCommand(app, &exit_code);
  tensorstash::cli::AddConvertCommand(app, &exit_code);
  CLI11_PARSE(app, argc, argv);
  return exit_code;
}
