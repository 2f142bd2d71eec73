"""Rows of an accuracy table given by the user: ``LABEL=POLICY[:key=value,...]``.

``POLICY`` is a registered name (``growpage``, ``fixed``, ...), ``package.module:ClassName`` or
``path/file.py:ClassName``. Each ``key=value`` is a hyperparameter of the policy class, or, when
the class has no field of that name, a ``GrowPageConfig`` setting of that row alone
(``floor_tokens``, ``protect_prompt``, ``beta_long``, ``summary_start``, ...)::

    fixed-256=fixed:budget_tokens=256
    gp-f64=growpage:floor_tokens=64,beta_long=0.99
    mine=my_policy.py:MyPolicy:threshold=0.1

A value ``@LABEL.budget`` is the average KV budget of an earlier row (rounded to whole pages),
``@LABEL.grow_ratio`` its share of decided boundaries that grew (3 decimals): baselines matched
to another row (``h2o-at-gp=h2o:budget_tokens=@gp-f64.budget``) wait for that row.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import attrs

from growpage.core.config import GrowPageConfig
from growpage.errors import ConfigError, GrowPageError, PolicyError
from growpage.policies.registry import (
    parse_policy_value,
    policy_class,
    registered_policies,
    resolve_policy,
)

#: GrowPageConfig settings a row may not change: the table's pool shares one page size.
TABLE_WIDE = ("page_size",)
#: What a ``@LABEL.what`` reference reads of a row.
REFERENCES = ("budget", "grow_ratio")
_REFERENCE = re.compile(r"^@(?P<label>[^.\s]+)\.(?P<what>\w+)$")
_LABEL = re.compile(r"^[A-Za-z0-9_.+-]+$")


@attrs.frozen
class Reference:
    """A value taken from an earlier row's results: ``@label.what``."""

    label: str
    what: str

    def __str__(self) -> str:
        return f"@{self.label}.{self.what}"


@attrs.frozen
class RowSpec:
    """One row as given: ``policy`` with its hyperparameters ``params`` and the row's own
    ``GrowPageConfig`` settings ``config``; values may be ``Reference``s."""

    label: str
    policy: str
    params: dict[str, Any] = attrs.field(factory=dict)
    config: dict[str, Any] = attrs.field(factory=dict)

    def to_text(self) -> str:
        items = {**self.params, **self.config}
        tail = ",".join(f"{k}={_text(v)}" for k, v in items.items())
        return f"{self.label}={self.policy}" + (f":{tail}" if tail else "")

    @property
    def references(self) -> list[Reference]:
        values = [*self.params.values(), *self.config.values()]
        return [v for v in values if isinstance(v, Reference)]


def _text(value: Any) -> str:
    if isinstance(value, Reference):
        return str(value)
    return (
        "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    )


def parse_row(text: str) -> RowSpec:
    """``LABEL=POLICY[:key=value,...]`` -> ``RowSpec`` (``ConfigError`` naming the problem)."""
    label, eq, rest = text.partition("=")
    label = label.strip()
    if not eq or not label or not rest.strip():
        raise ConfigError(f"row {text!r}: expected LABEL=POLICY[:key=value,...]")
    if not _LABEL.match(label):
        raise ConfigError(
            f"row {text!r}: a label is letters, digits and _ . + - (it names the row's output "
            f"file), got {label!r}"
        )
    head, colon, tail = rest.rpartition(":")
    if colon and "=" in tail:
        spec, items = head.strip(), [i for i in tail.split(",") if i.strip()]
    else:
        spec, items = rest.strip(), []
        if colon and head.strip() in registered_policies():
            raise ConfigError(
                f"row {text!r}: expected key=value after {head.strip()}:, got {tail!r}"
            )
    try:
        cls = policy_class(spec)
    except PolicyError as exc:
        raise ConfigError(f"row {text!r}: {exc}") from exc
    fields = _fields_of(cls)
    settings = {f.name for f in attrs.fields(GrowPageConfig)}
    params: dict[str, Any] = {}
    config: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError(f"row {text!r}: expected key=value, got {item.strip()!r}")
        if key in params or key in config:
            raise ConfigError(f"row {text!r}: {key} given twice")
        parsed = _value(value, text)
        if key in fields:
            params[key] = parsed
        elif key in TABLE_WIDE:
            raise ConfigError(f"row {text!r}: {key} is the table's (one pool), not a row's")
        elif key in settings:
            config[key] = parsed
        else:
            raise ConfigError(
                f"row {text!r}: {key!r} is neither a hyperparameter of {spec} "
                f"({', '.join(sorted(fields)) or 'none'}) nor a GrowPageConfig setting "
                f"({', '.join(sorted(settings - set(TABLE_WIDE)))})"
            )
    return RowSpec(label, spec, params, config)


def _value(text: str, row: str) -> Any:
    m = _REFERENCE.match(text.strip())
    if m is None:
        return parse_policy_value(text)
    if m["what"] not in REFERENCES:
        raise ConfigError(
            f"row {row!r}: {text.strip()!r} reads {m['what']!r} of a row; known: "
            f"{', '.join(REFERENCES)}"
        )
    return Reference(m["label"], m["what"])


def _fields_of(cls: type) -> set[str]:
    """The hyperparameters ``cls`` takes: its attrs fields, else its constructor's names."""
    if attrs.has(cls):
        return {f.name for f in attrs.fields(cls) if f.init}
    names = inspect.signature(cls).parameters
    return {n for n, p in names.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def check_rows(rows: list[RowSpec]) -> None:
    """Labels unique; every reference to an earlier row."""
    seen: set[str] = set()
    for row in rows:
        if row.label in seen:
            raise ConfigError(f"two rows are labelled {row.label!r}")
        for ref in row.references:
            if ref.label not in seen:
                raise ConfigError(
                    f"row {row.to_text()!r} reads {ref} of a row that is not given before it"
                )
        seen.add(row.label)


def check_buildable(row: RowSpec, base: GrowPageConfig) -> None:
    """Build what ``row`` runs with, before any model loads: its policy and its settings over
    the table's ``base`` (``ConfigError`` naming the row). A part that holds a ``Reference`` is
    only partly known until that row has run: each of its literal values is checked alone."""
    # NOTE: a check across fields (beta_short < beta_long, a policy's constructor) needs the
    # referenced value too; it runs when the row is built, after the row it reads.
    try:
        if _is_known(row.params):
            resolve_policy(row.policy, **row.params)
        else:
            _check_alone(policy_class(row.policy), row.params)
        if _is_known(row.config):
            base.replace(**row.config)
        else:
            _check_alone(GrowPageConfig, row.config)
    except (GrowPageError, TypeError, ValueError) as exc:
        raise ConfigError(f"row {row.to_text()!r}: {_first_line(exc)}") from exc


def _is_known(values: dict[str, Any]) -> bool:
    return not any(isinstance(v, Reference) for v in values.values())


def _check_alone(cls: type, values: dict[str, Any]) -> None:
    """Each literal value of ``values`` through its attrs field's converter and validator (a
    class that is not attrs checks its arguments together in its constructor: nothing here)."""
    if not attrs.has(cls):
        return
    fields = attrs.fields_dict(cls)
    blank = object.__new__(cls)  # validators name the class; they get no other field of it
    for key, value in values.items():
        field = fields[key]
        if isinstance(value, Reference) or isinstance(field.converter, attrs.Converter):
            continue  # an attrs.Converter may read the other fields
        if field.converter is not None:
            value = field.converter(value)
        if field.validator is not None:
            try:
                field.validator(blank, field, value)
            except AttributeError:  # the validator reads another field: it waits with them
                continue


def _first_line(exc: BaseException) -> str:
    """attrs' ``instance_of`` raises ``TypeError(message, attribute, type, value)``: its
    message; any other error its text."""
    args = exc.args
    return args[0] if len(args) > 1 and isinstance(args[0], str) else str(exc)


def resolved(row: RowSpec, results: dict[str, dict[str, Any]], page_size: int) -> RowSpec:
    """``row`` with its references replaced by the values of the rows in ``results`` (by
    label); ``KeyError`` when one is not there yet."""

    def value(v: Any) -> Any:
        if not isinstance(v, Reference):
            return v
        done = results[v.label]
        if v.what == "budget":
            return max(2, round(done["avg_budget"] / page_size)) * page_size
        decided = done["decided_grow"] + done["decided_compress"]
        return round(done["decided_grow"] / decided, 3) if decided else 0.5

    return RowSpec(
        row.label,
        row.policy,
        {k: value(v) for k, v in row.params.items()},
        {k: value(v) for k, v in row.config.items()},
    )
