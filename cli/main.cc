// tensorstash: list, inspect, verify and convert checkpoints.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"tensorstash: inspect, verify and convert tensorstash checkpoints"};
  app.require_subcommand(1);
  int exit_code = 0;
  tensorstash::cli::AddLsCommand(app, &exit_code);
  tensorstash::cli::AddInspectCommand(app, &exit_code);
  tensorstash::cli::AddVerifyCommand(app, &exit_code);
  tensorstash::cli::AddConvertCommand(app, &exit_code);
  // The library does not throw; this is the last line of defence against an allocation that
  // fails (std::bad_alloc) or a library we call that throws: an error message and exit 2,
  // never an abort.
  try {
    CLI11_PARSE(app, argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  return exit_code;
}
