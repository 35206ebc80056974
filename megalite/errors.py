"""One error type for bad input, and the guard that turns it into one clear line."""

import os
import sys


class MegaliteError(Exception):
    """Bad input. The message is one sentence naming what is wrong and how to fix it.

    `every_rank`: the message is particular to this rank (a peer it waited on, a file only its
    node lacks), so every rank prints its own; otherwise the ranks all found the same problem
    and only the first rank of each node prints it.
    """

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


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
        if e.every_rank or int(os.environ.get("LOCAL_RANK", 0)) == 0:
            print(f"megalite: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
