"""Turn ``policy=`` (a built-in name, a class, or a ``"module:Class"`` string) into a class."""

from __future__ import annotations

import importlib
import inspect
import traceback

from kvoffload.policies.arc import ArcPolicy
from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.duel import DuelPolicy
from kvoffload.policies.lru import LruPolicy
from kvoffload_spec.errors import UnknownPolicyError

BUILTIN_POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LruPolicy,
    "arc": ArcPolicy,
    "duel": DuelPolicy,
}
"""The registry: every built-in policy class by its name, the one table of them. The CLI,
the sweep and the engine adapters read their names here; the spec, which cannot import
this package, lists the same names in ``kvoffload_spec.policies.POLICY_NAMES`` (a test
holds the two equal)."""


def resolve_policy(policy: object) -> type[EvictionPolicy]:
    """The policy class ``policy`` names; raises ``UnknownPolicyError`` if there is none.

    Accepted: a built-in name (a key of ``BUILTIN_POLICIES``), a concrete subclass of
    :class:`EvictionPolicy`, or ``"package.module:ClassName"``, which imports the module.
    """
    if isinstance(policy, str):
        builtin = BUILTIN_POLICIES.get(policy)
        if builtin is not None:
            return builtin
        if ":" in policy:
            return _usable(_import(policy), policy)
    elif isinstance(policy, type):
        return _usable(policy, policy.__qualname__)
    raise UnknownPolicyError(
        f"unknown policy {policy!r}: choose one of {', '.join(BUILTIN_POLICIES)}, "
        "an EvictionPolicy subclass, or 'module:Class'"
    )


def _import(path: str) -> object:
    module_name, _, attribute = path.partition(":")
    try:
        found: object = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and _names_a_parent(error.name, module_name):
            raise UnknownPolicyError(
                f"policy {path!r}: cannot import {module_name!r}: no module {error.name!r} in "
                "the current directory or on PYTHONPATH"
            ) from None
        raise _import_failed(path, module_name, error) from error
    except ValueError:  # an empty or relative module name ("", ".x")
        raise UnknownPolicyError(
            f"policy {path!r}: {module_name!r} is not a module name (expected 'module:Class')"
        ) from None
    except Exception as error:  # the module's own code failed while it was imported
        raise _import_failed(path, module_name, error) from error
    for name in attribute.split("."):
        if not hasattr(found, name):
            raise UnknownPolicyError(f"policy {path!r}: {module_name!r} has no {attribute!r}")
        found = getattr(found, name)
    return found


def _names_a_parent(missing: str, module_name: str) -> bool:
    """Whether the missing module is ``module_name`` or a package above it, rather than
    something the module itself imports."""
    return module_name == missing or module_name.startswith(missing + ".")


def _import_failed(path: str, module_name: str, error: Exception) -> UnknownPolicyError:
    """One line naming the cause, and where it is, of a module that exists but does not
    import."""
    if isinstance(error, SyntaxError):
        where = f"{error.filename}, line {error.lineno}" if error.filename else "its source"
        cause = f"{type(error).__name__} in {where}: {error.msg}"
    else:
        frames = traceback.extract_tb(error.__traceback__)
        ours = [frame for frame in frames if "importlib" not in frame.filename]
        where = f" ({ours[-1].filename}, line {ours[-1].lineno})" if ours else ""
        cause = f"{type(error).__name__}: {error}{where}"
    return UnknownPolicyError(f"policy {path!r}: importing {module_name!r} failed: {cause}")


def _usable(candidate: object, label: str) -> type[EvictionPolicy]:
    if not (isinstance(candidate, type) and issubclass(candidate, EvictionPolicy)):
        raise UnknownPolicyError(f"policy {label!r} is not an EvictionPolicy subclass")
    if inspect.isabstract(candidate):
        raise UnknownPolicyError(f"policy {label!r} leaves abstract methods unimplemented")
    try:
        inspect.signature(candidate).bind(1)
    except TypeError:
        raise UnknownPolicyError(
            f"policy {label!r} cannot be built as {candidate.__name__}(capacity): its "
            f"constructor takes {inspect.signature(candidate)}; give the other parameters "
            "defaults"
        ) from None
    except ValueError:  # no signature to read (a class built in C): let the call decide
        pass
    return candidate
