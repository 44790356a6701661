"""ncap: an OpenAI-compatible Chat Completions gateway that makes ``n`` correct and affordable."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ncap")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0"

__all__ = ["__version__"]
