"""Resolving a policy from a name, ``"package.module:ClassName"`` or ``"path/file.py:ClassName"``."""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import attrs

from growpage.errors import ConfigError, GrowPageError, PolicyError
from growpage.policies.base import CapacityPolicy

_REGISTRY: dict[str, type[CapacityPolicy]] = {}
PolicyT = TypeVar("PolicyT", bound=CapacityPolicy)


def register_policy(cls: type[PolicyT]) -> type[PolicyT]:
    """Class decorator: make a policy resolvable by its ``name``.

    A class of the same module and qualified name replaces the registered one (the module was
    run again: reloaded, or a policy file fixed after a failed load)."""
    if not (isinstance(cls, type) and issubclass(cls, CapacityPolicy)):
        raise PolicyError(f"register_policy takes a CapacityPolicy subclass, got {cls!r}")
    name = cls.__dict__.get("name", getattr(cls, "name", None))
    if not isinstance(name, str) or not name or ":" in name:
        hint = (
            " (an annotated `name: str = ...` in an attrs class is a field, not the class's "
            'name: write `name = "..."` without the annotation)'
            if not isinstance(name, str)
            else ""
        )
        raise PolicyError(
            f"policy class {cls.__name__} has no usable name to register: "
            f"name is {name!r}, expected a non-empty string without ':'{hint}"
        )
    if name in _REGISTRY and _qualified(_REGISTRY[name]) != _qualified(cls):
        raise PolicyError(
            f"policy name {name!r} is already registered by "
            f"{_REGISTRY[name].__module__}.{_REGISTRY[name].__qualname__}"
        )
    _REGISTRY[name] = cls
    return cls


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def registered_policies() -> dict[str, type[CapacityPolicy]]:
    import growpage.policies.builtin  # noqa: F401 - registers the built-ins

    return dict(sorted(_REGISTRY.items()))


def _load_class(spec: str) -> type:
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise PolicyError(
            f"policy {spec!r}: expected a registered name, "
            "'package.module:ClassName' or 'path/file.py:ClassName'"
        )
    if target.endswith(".py"):
        module = _load_file(Path(target))
    else:
        try:
            module = importlib.import_module(target)
        except SystemExit as exc:
            raise PolicyError(f"cannot import policy module {target!r}: {_exited(exc)}") from exc
        except Exception as exc:  # noqa: BLE001 - whatever the module raised while importing
            raise PolicyError(
                f"cannot import policy module {target!r}: "
                f"{type(exc).__name__}: {exc}{_file_hint(exc, target, attr)}"
            ) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise PolicyError(f"{target!r} has no attribute {attr!r}{_classes_hint(module)}") from None


def _classes_hint(module: ModuleType) -> str:
    """The policy classes ``module`` defines, for a name that is not one of them."""
    names = [
        name
        for name, value in vars(module).items()
        if isinstance(value, type)
        and issubclass(value, CapacityPolicy)
        and not name.startswith("_")
        and value.__module__ == module.__name__
    ]
    return (
        f" (its policy classes: {', '.join(names)})" if names else " (it defines no policy class)"
    )


def _file_hint(exc: Exception, target: str, attr: str) -> str:
    """For a module that is not found: how to name it as a file instead (a console script does
    not have the current directory on ``sys.path``)."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if not missing or not (target == missing or target.startswith(missing + ".")):
        return ""
    path = Path(*target.split(".")).with_suffix(".py")
    if path.is_file():
        return f"; to load the file {path}, give '{path}:{attr}'"
    return f"; a policy in a file is given as 'path/file.py:{attr}'"


def _load_file(path: Path) -> ModuleType:
    """The module of a policy file, run once per process (as ``import`` runs a module); the
    file's directory goes on ``sys.path`` (at its end), so the modules beside it import.

    NOTE: callers resolve the same spec many times (one policy object per replayed trace);
    running the file again would re-register its policies as new classes. The module name
    comes from the resolved path, so two files with the same name do not collide."""
    if not path.is_file():
        raise PolicyError(f"policy file {path} does not exist")
    path = path.resolve()
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    mod_name = f"growpage_user_policy_{path.stem}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    # An explicit loader: the resolved path of a symlinked ``.py`` file may have another suffix,
    # for which importlib would find no loader.
    loader = importlib.machinery.SourceFileLoader(mod_name, str(path))
    module_spec = importlib.util.spec_from_file_location(mod_name, path, loader=loader)
    if module_spec is None:
        raise PolicyError(f"cannot load policy file {path}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module  # the file may import itself (attrs, dataclasses look it up)
    # As for a script, modules beside the file import (`from helpers import X`); appended, not
    # prepended, so that a file there cannot shadow the standard library or installed packages.
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    try:
        loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[mod_name]  # no half-run module: a fixed file loads next time
        if isinstance(exc, SystemExit):
            raise PolicyError(f"cannot load policy file {path}: {_exited(exc)}") from exc
        if not isinstance(exc, Exception):
            raise
        raise PolicyError(f"cannot load policy file {path}: {type(exc).__name__}: {exc}") from exc
    return module


def _exited(exc: SystemExit) -> str:
    """Why a policy module that ended the process at import (``sys.exit``, a script's
    ``argparse`` reading growpage's own arguments) is refused, in place of that exit."""
    return (
        f"it exited at import (SystemExit({exc.code!r})); run a script's main only under "
        '`if __name__ == "__main__":`'
    )


def resolve_policy(
    spec: str | CapacityPolicy | type[CapacityPolicy], **kwargs: Any
) -> CapacityPolicy:
    """A policy instance from an instance, a class, a registered name or an import spec.

    ``kwargs`` are passed to the class (its hyperparameters).
    """
    if isinstance(spec, CapacityPolicy):
        if kwargs:
            raise PolicyError("hyperparameters cannot be given with a policy instance")
        return spec
    cls = policy_class(spec)
    try:
        return cls(**kwargs)
    except GrowPageError as exc:  # the built-ins' validators: their message names the field
        raise PolicyError(
            f"cannot build policy {getattr(cls, 'name', cls)!r}: {exc}{_fields_hint(cls, kwargs)}"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - whatever a user's constructor raises
        hint = _fields_hint(cls, kwargs) if isinstance(exc, TypeError) else ""
        raise PolicyError(
            f"cannot build policy {getattr(cls, 'name', cls)!r}: {_constructor_error(exc)}{hint}"
        ) from exc


def policy_class(spec: str | type[CapacityPolicy]) -> type[CapacityPolicy]:
    """The policy class a registered name, ``"package.module:ClassName"`` or
    ``"path/file.py:ClassName"`` names (a class is checked and returned)."""
    if isinstance(spec, str):
        if ":" in spec:
            cls = _load_class(spec)
        else:
            known = registered_policies()
            if spec not in known:
                raise PolicyError(
                    f"unknown policy {spec!r}; registered: {', '.join(known)} "
                    "(or give 'package.module:ClassName' / 'file.py:ClassName')"
                )
            cls = known[spec]
    else:
        cls = spec
    if not (isinstance(cls, type) and issubclass(cls, CapacityPolicy)):
        raise PolicyError(f"{spec!r} is not a CapacityPolicy subclass{_what(cls)}")
    return cls


def _what(value: object) -> str:
    """What a policy spec named instead of a policy class."""
    if isinstance(value, type) or hasattr(value, "decide"):
        return " (a policy class subclasses growpage.CapacityPolicy)"
    return f" (got {type(value).__name__}; give a policy class or instance)"


def _constructor_error(exc: Exception) -> str:
    """What a policy's constructor raised, in one line: attrs' ``instance_of`` validator raises
    ``TypeError(message, attribute, type, value)``, whose ``str`` is the whole tuple; its first
    argument is the message. An exception other than TypeError / ValueError gets its type."""
    text = exc.args[0] if len(exc.args) > 1 and isinstance(exc.args[0], str) else str(exc)
    return text if isinstance(exc, (TypeError, ValueError)) else f"{type(exc).__name__}: {text}"


def _fields_hint(cls: type, kwargs: dict[str, Any]) -> str:
    """For an attrs policy given a hyperparameter it does not have: the ones it has."""
    if not attrs.has(cls):
        return ""
    fields = [f.name for f in attrs.fields(cls) if f.init]
    if all(key in fields for key in kwargs):
        return ""
    return f" (its hyperparameters: {', '.join(fields) or 'none'})"


def parse_policy_value(text: str) -> Any:
    """A hyperparameter value from a command line: JSON (``1024``, ``null``, ``"x"``), else a
    Python literal (``None``, ``True``, ``1e-3``), else the text itself; spaces around it are
    ignored."""
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return text


def parse_policy_params(items: list[str], flag: str = "--param") -> dict[str, Any]:
    """``["key=value", ...]`` from a command line -> policy kwargs (``parse_policy_value``)."""
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # each key's text as given, for the error naming both
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()  # "tau = 0.01", as spaces around the value are ignored
        if not eq or not key:
            raise ConfigError(f"{flag} expects KEY=VALUE, got {item!r}")
        if key in out:
            raise ConfigError(
                f"{flag} {key} given twice ({given[key]!r} and {item!r}); "
                "give each hyperparameter once"
            )
        out[key], given[key] = parse_policy_value(value), item
    return out
