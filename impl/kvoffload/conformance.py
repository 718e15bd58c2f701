"""The conformance kit's first home: it lives in :mod:`kvoffload.checking.conformance`
now, with the other checking harnesses; this name stays so that existing imports work."""

from kvoffload.checking.conformance import (
    ConformanceError,
    ConformanceMachine,
    ManagerFactory,
    check_conformance,
    check_directed_histories,
    conformance_machine,
)

__all__ = [
    "ConformanceError",
    "ConformanceMachine",
    "ManagerFactory",
    "check_conformance",
    "check_directed_histories",
    "conformance_machine",
]
