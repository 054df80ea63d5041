"""Errors that carry one clear message: what is wrong, the value, and the fix."""


class SpecflowError(Exception):
    """Base class of every error specflow raises on purpose."""


class ConfigError(SpecflowError, ValueError):
    """A config value or a combination of stages that cannot work."""


class ModelNotFoundError(SpecflowError, FileNotFoundError):
    """A model that is neither prepared locally nor installable from where we are."""


class PromptTooLongError(SpecflowError, ValueError):
    """A prompt (plus the tokens to generate) that does not fit the model's context."""
