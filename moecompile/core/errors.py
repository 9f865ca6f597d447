"""User-facing errors: one line, shown by the CLI without a traceback (exit code 2)."""


class MoECompileError(Exception):
    """A problem with the user's input (model, flags, checkpoint), not a bug in moecompile."""
