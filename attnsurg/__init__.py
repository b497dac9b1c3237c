"""attnsurg: attention surgery for pretrained causal language models."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("attnsurg")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+local"

from attnsurg.errors import UserError

__all__ = ["UserError", "__version__"]
