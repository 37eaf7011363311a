"""The console script's entry point (``poollab``, ``python -m poollab``).

It imports nothing but the standard library before it can catch Ctrl-C: loading the command
line pulls in pandas, pyarrow and the simulator (a second or more), and an interrupt during that
import must end like one at any other time, in one line with exit status 130, not a traceback.
"""

import sys


def run(argv: list[str] | None = None) -> None:
    try:
        from poollab.cli import main
    except KeyboardInterrupt:
        sys.stderr.write("poollab: interrupted\n")
        sys.exit(130)
    main(argv)


if __name__ == "__main__":
    run()
