"""The one error type every layer raises for bad user input. A leaf: it imports nothing of the package, so any
module may raise it without an import reaching back up the layers."""


class ConfigError(Exception):
    """Bad user input. train.py prints it as one line and exits non-zero, without a traceback."""
