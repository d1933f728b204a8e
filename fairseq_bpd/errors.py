"""BlockwiseRequestError: every request the plugin refuses, and how fairseq's commands show it."""
import sys


class BlockwiseRequestError(ValueError):
    """A request the plugin cannot honour exactly; the message names the flag.

    Python callers (the hub's translate, task.build_generator) catch it like any
    ValueError. A command that does not catch it (fairseq-generate, fairseq-interactive,
    fairseq-train) prints `error: <message>` on one line to stderr and exits with status
    1, as a command-line tool refuses a bad flag: a 20-line traceback reads as a crash.
    One raised while another error was being handled keeps Python's report of both.
    """


def _print_refusals(fallback):
    def excepthook(kind, value, traceback):
        # A refusal raised while another error was being handled is not the whole story.
        chained = value.__cause__ is not None or (value.__context__ is not None and not value.__suppress_context__)
        if isinstance(value, BlockwiseRequestError) and not chained:
            print(f"error: {value}", file=sys.stderr)
        else:
            fallback(kind, value, traceback)

    return excepthook


# Only uncaught exceptions reach the hook, so callers that catch the error see no change.
sys.excepthook = _print_refusals(sys.excepthook)
