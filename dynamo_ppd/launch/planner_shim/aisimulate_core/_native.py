"""`aisimulate_core._native`: the native perf model, absent (see the package's docstring)."""

from . import RustForwardPassPerfModel

__all__ = ["RustForwardPassPerfModel"]
