"""What every stage of conveyor agrees on: settings, Redis names, message schemas, the job model."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("conveyor")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0+source"
