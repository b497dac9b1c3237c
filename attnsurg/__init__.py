"""attnsurg: attention surgery for pretrained causal language models.

The commands as functions (``attnsurg.api``): ``convert``, ``compress``, ``evaluate`` and ``run``.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("attnsurg")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+local"

from attnsurg.errors import UserError

API = ("convert", "compress", "evaluate", "run")
__all__ = ["UserError", "__version__", *API]


def __getattr__(name: str):
    """``attnsurg.convert`` and the rest load the library on first use, so ``import attnsurg`` stays light."""
    if name in API:
        from attnsurg import api

        return getattr(api, name)
    raise AttributeError(f"module 'attnsurg' has no attribute {name!r}")
