"""One error type for bad input, and the guard that turns it into one clear line."""

import sys


class MegaliteError(Exception):
    """Bad input. The message is one sentence naming what is wrong and how to fix it."""


def run_main(main, argv=None):
    """Run an entry point; bad input ends it with one line on stderr and exit status 2.

    `--debug` anywhere on the command line shows the full traceback instead.
    """
    argv = sys.argv[1:] if argv is None else argv
    try:
        return main(argv)
    except MegaliteError as e:
        if "--debug" in argv:
            raise
        print(f"megalite: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
