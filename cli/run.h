// The tensorstash command: `Run(argc, argv)` is its whole main(), for the executable and for the
// Python package's `tensorstash` command (the wheel has no separate executable).
#ifndef TENSORSTASH_CLI_RUN_H_
#define TENSORSTASH_CLI_RUN_H_

namespace tensorstash::cli {

// Parses the arguments, runs the subcommand, and returns the exit code: 0 on success, 1 when
// the subcommand found a problem (a damaged checkpoint), 2 for an error. Never throws.
int Run(int argc, char** argv);

}  // namespace tensorstash::cli

#endif  // TENSORSTASH_CLI_RUN_H_
