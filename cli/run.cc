#include "run.h"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "commands.h"
#include "tensorstash/version.h"

namespace tensorstash::cli {

int Run(int argc, char** argv) {
  CLI::App app{"tensorstash: inspect, verify and convert tensorstash checkpoints"};
  app.set_version_flag("--version", std::string("tensorstash ") + kVersion);
  app.require_subcommand(1);
  int exit_code = 0;
  AddLsCommand(app, &exit_code);
  AddInspectCommand(app, &exit_code);
  AddVerifyCommand(app, &exit_code);
  AddConvertCommand(app, &exit_code);
  AddGcCommand(app, &exit_code);
  // The library does not throw; this is the last line of defence against an allocation that
  // fails (std::bad_alloc) or a library we call that throws: an error message and exit 2,
  // never an abort.
  try {
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return app.exit(e);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  std::fflush(stdout);
  return exit_code;
}

}  // namespace tensorstash::cli
