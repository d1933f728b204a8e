"""The plugin's refusals: a request it cannot honour exactly, a checkpoint it cannot load.

Both are ordinary exceptions: a Python caller catches them like any other. How
fairseq's commands show an uncaught refusal (one line, no traceback) is an import-time
patch, in patches.py.
"""


class BlockwiseRequestError(ValueError):
    """A request the plugin cannot honour exactly; the message names the flag.

    Python callers (the hub's translate, task.build_generator) catch it like any
    ValueError. A fairseq command that does not catch it (fairseq-generate,
    fairseq-interactive, fairseq-train) prints `error: <message>` on one line to stderr
    and exits with status 1, as a command-line tool refuses a bad flag: a 20-line
    traceback reads as a crash. One raised while another error was being handled keeps
    Python's report of both.
    """


class CheckpointError(RuntimeError):
    """A checkpoint that cannot or may not be loaded; the message says what to do."""
