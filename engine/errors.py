"""User-facing errors of the engine.

An ``EngineError`` is a problem with the user's input (a file, a setting), not a bug: the
CLI prints its message on one line and exits with status 2, without a traceback.
"""


class EngineError(Exception):
    """A problem with the user's input, reported in one clear sentence."""


class GGUFError(EngineError):
    """A GGUF file that cannot be read as the model it claims to be."""


class ConfigError(EngineError):
    """A setting outside what the engine supports."""


class IncompatibleModelError(EngineError):
    """Two models that cannot work together (a draft or drafter against its target)."""


class GenerationStalled(EngineError):
    """A generation that made no progress within its time limit."""
