// The CLI's commands. Each registers its subcommand on the app; the logic lives in the library.
#ifndef TENSORSTASH_CLI_COMMANDS_H_
#define TENSORSTASH_CLI_COMMANDS_H_

#include <CLI/CLI.hpp>

namespace tensorstash::cli {

// Each Add* registers a subcommand whose callback stores its exit code in *exit_code.
void AddLsCommand(CLI::App& app, int* exit_code);
void AddInspectCommand(CLI::App& app, int* exit_code);
void AddVerifyCommand(CLI::App& app, int* exit_code);
void AddConvertCommand(CLI::App& app, int* exit_code);
void AddGcCommand(CLI::App& app, int* exit_code);

}  // namespace tensorstash::cli

#endif  // TENSORSTASH_CLI_COMMANDS_H_
