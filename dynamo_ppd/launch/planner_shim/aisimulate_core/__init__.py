"""Stands in for NVIDIA's AISimulate SDK, which is not installable from PyPI (see ../README.md):
the planner can import it and describe the model it would ask for, and asking for the model
raises ImportError, the planner's "not installed" path."""

ABSENT = ("aisimulate_core is not installed (NVIDIA's package index only); the planner goes on "
          "without its AIS engine perf model")


class RustForwardPassPerfModel:
    """The native forward-pass perf model: never available here."""

    @classmethod
    def best_available(cls, *_args: object, **_kwargs: object) -> None:
        raise ImportError(ABSENT)

    @staticmethod
    def normalize_config(*_args: object, **_kwargs: object) -> None:
        raise ImportError(ABSENT)
