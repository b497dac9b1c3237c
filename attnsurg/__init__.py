"""attnsurg: attention surgery for pretrained causal language models.

The commands as functions (``attnsurg.api``): ``convert``, ``compress``, ``evaluate`` and ``run``; ``load``
returns a model ready to generate and its tokenizer (``attnsurg.generate``).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("attnsurg")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+local"

from attnsurg.errors import UserError

API = ("convert", "compress", "evaluate", "run")
__all__ = ["UserError", "__version__", "load", *API]


def __getattr__(name: str):
    """``attnsurg.convert`` and the rest load the library on first use, so ``import attnsurg`` stays light."""
    if name in API:
        from attnsurg import api

        return getattr(api, name)
    if name == "load":
        from attnsurg.generate import load

        return load
    raise AttributeError(f"module 'attnsurg' has no attribute {name!r}")
