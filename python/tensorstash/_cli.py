"""The `tensorstash` command of an installed package: the same command as the build's
`build/tensorstash` executable (ls, inspect, verify, convert), run in this process by the
extension."""

import signal
import sys

from . import _ext


def main() -> None:
    # Ctrl-C stops the command at once, as it stops the executable: the command runs without
    # the GIL, where Python's own handler would wait for it to end.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.stdout.flush()
    sys.exit(_ext.cli_main(["tensorstash", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
