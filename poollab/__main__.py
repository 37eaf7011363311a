"""The console script's entry point (``poollab``, ``python -m poollab``).

It imports nothing but the standard library before it can catch Ctrl-C: loading the command
line pulls in pandas, pyarrow and the simulator (a second or more), and an interrupt during that
import must end like one at any other time, in one line with exit status 130, not a traceback.
"""

import gc
import sys


def run(argv: list[str] | None = None) -> None:
    """Run the command line; the process ends after it (the console script's whole life).

    A command that returns has written and closed its files (every one through ``with``), so
    what the interpreter's exit would still do with the objects it made is free them one by one:
    its last collection breaks the cycles of every module, function and class imported (pandas,
    pyarrow, the policies) and frees what they held, 0.08 s of a million-event ``replay``'s wall
    on the dev container (``benchmarks/RESULTS.md``, session 20 t2). ``gc.freeze`` first moves
    them out of the collector's reach, so the exit leaves their memory to the operating system,
    as it leaves a worker's; ``atexit`` handlers still run and the standard streams are still
    flushed. Only here, where the process ends: a caller of ``poollab.cli.main`` (the tests, a
    script) keeps a collector that sees its objects.
    """
    try:
        from poollab.cli import main
    except KeyboardInterrupt:
        sys.stderr.write("poollab: interrupted\n")
        sys.exit(130)
    main(argv)
    gc.freeze()


if __name__ == "__main__":
    run()
