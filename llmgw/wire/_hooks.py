"""The hooks that make llmgw's one converter strict: scalars of the exact type, lists and mappings as such.

Used by :data:`llmgw.wire.converter` only; every reader of JSON, YAML or
TOML in llmgw goes through that converter.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Mapping
from itertools import islice
from typing import Any, get_args, get_origin

import attrs
import cattrs
from cattrs.errors import IterableValidationError, IterableValidationNote
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, make_mapping_structure_fn, override

from llmgw.models import Autoscale, Model, Profile, Rollout, ScaleTarget, Sidecar

__all__ = [
    "EXPECTED", "MAX_ITEM_ERRORS", "MAX_PROBLEMS", "register_strict_scalars", "register_strict_collections",
    "shown", "capped", "register_catalog_records",
]  # fmt: skip

#: Why a scalar was refused, by the type expected.
EXPECTED = {
    int: "expected an integer",
    str: "expected a string",
    bool: "expected true or false",
    float: "expected a number",
}


#: the bad items of one list that are named before the rest of the list is left unread
MAX_ITEM_ERRORS = 10
#: the longest value an error text quotes
_SHOWN = 60


class _BoundedRepr(reprlib.Repr):
    """A repr that reads at most a few items of each collection, a few levels deep: its cost does not grow
    with the value (a list of 10**8 items, YAML aliases expanded, costs what a short one does)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxdict = self.maxset = self.maxfrozenset = 4
        self.maxstring = self.maxlong = self.maxother = _SHOWN

    def repr_dict(self, x: dict, level: int) -> str:
        """reprlib's, without sorting every key first: the first few, in order."""
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}" for k, v in islice(x.items(), 4)]
        return "{" + ", ".join(items) + (", ...}" if len(x) > len(items) else "}")


_BOUNDED = _BoundedRepr()


def shown(value: Any) -> str:
    """``value`` as an error text quotes it: a repr of at most 60 characters, built from a bounded part of
    ``value`` (never from all of it)."""
    text = _BOUNDED.repr(value)
    return text if len(text) <= _SHOWN else f"{text[: _SHOWN - 3]}..."


#: the problems an error lists, and the longest line it shows of each
MAX_PROBLEMS = 20
_LINE = 300


def capped(problems: list[str]) -> list[str]:
    """``problems`` as an error lists them: the first :data:`MAX_PROBLEMS`, each cut to 300 characters, and
    a last line saying how many more there were. Called on every refused wire document and catalog."""
    lines = [p if len(p) <= _LINE else f"{p[: _LINE - 3]}..." for p in problems[:MAX_PROBLEMS]]
    if len(problems) > MAX_PROBLEMS:
        lines.append(f"... and {len(problems) - MAX_PROBLEMS} more")
    return lines


def _got(value: Any) -> str:
    return f"got {shown(value)}"


def _strict(kind: type) -> Callable[[Any, type], Any]:
    def structure(value: Any, _: type) -> Any:
        # bool is an int in Python; JSON's and YAML's `true` must not pass for a count.
        if type(value) is not kind and not (kind is float and type(value) is int):
            raise TypeError(f"{EXPECTED[kind]}, {_got(value)}")
        return float(value) if kind is float else value

    return structure


def register_strict_scalars(converter: cattrs.Converter) -> None:
    """Make ``converter`` refuse ``"8000"``, ``8000.9`` and ``true`` where an int is expected, and alike."""
    for kind in (int, str, bool, float):
        converter.register_structure_hook(kind, _strict(kind))


def _is_homogeneous_tuple(kind: Any) -> bool:
    args = get_args(kind)
    return get_origin(kind) is tuple and len(args) == 2 and args[1] is Ellipsis


def _is_mapping(kind: Any) -> bool:
    return get_origin(kind) in (dict, Mapping)


def register_strict_collections(converter: cattrs.Converter) -> None:
    """``tuple[X, ...]`` from a list only (not from a string), a mapping from a mapping only.

    Each bad item of a list is named by its index, as cattrs names it.
    """

    def tuple_hook(kind: Any) -> Callable[[Any, type], tuple]:
        item = get_args(kind)[0]

        def structure(value: Any, _: type) -> tuple:
            if not isinstance(value, list):
                raise TypeError(f"expected a list, {_got(value)}")
            out, errors = [], []
            for index, entry in enumerate(value):
                try:
                    out.append(converter.structure(entry, item))
                except Exception as exc:  # noqa: BLE001 - collected with its index as path
                    note = IterableValidationNote(f"Structuring {kind} @ index {index}", index, item)
                    exc.__notes__ = [*getattr(exc, "__notes__", []), note]
                    errors.append(exc)
                    if len(errors) == MAX_ITEM_ERRORS:  # enough to fix the list by; the rest stays unread
                        break
            if errors:
                raise IterableValidationError(f"While structuring {kind!r}", errors, kind)
            return tuple(out)

        return structure

    def mapping_hook(kind: Any) -> Callable[[Any, type], dict]:
        inner = make_mapping_structure_fn(kind, converter)

        def structure(value: Any, _: type) -> dict:
            if not isinstance(value, dict):
                raise TypeError(f"expected a mapping, {_got(value)}")
            return inner(value, kind)

        return structure

    converter.register_structure_hook_factory(_is_homogeneous_tuple, tuple_hook)
    converter.register_structure_hook_factory(_is_mapping, mapping_hook)


def _strict_mapping_of(kind: type, made: cattrs.Converter) -> Any:
    """The structure hook of a record people write nested in another (a model's ``rollout:``): a mapping
    of its own keys, none other. Called once per record type as the converter is made."""
    structure = make_dict_structure_fn(kind, made, _cattrs_forbid_extra_keys=True)
    keys = ", ".join(a.name for a in attrs.fields(kind))

    def structure_mapping(value: Any, _: type) -> Any:
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a mapping with the keys {keys}")
        return structure(value, kind)

    return structure_mapping


def register_catalog_records(made: cattrs.Converter) -> None:
    """Make ``made`` read the records people write in a catalog: no key of their own unknown.

    A model's ``autoscale`` is no key: :mod:`llmgw.catalog` fills it from ``replicas:`` given as a mapping.
    """
    for nested in (Rollout, ScaleTarget, Autoscale):  # in this order: Autoscale holds a ScaleTarget
        made.register_structure_hook(nested, _strict_mapping_of(nested, made))
    for written_by_people in (Profile, Sidecar):
        made.register_structure_hook(
            written_by_people, make_dict_structure_fn(written_by_people, made, _cattrs_forbid_extra_keys=True)
        )
    made.register_structure_hook(
        Model,
        make_dict_structure_fn(Model, made, _cattrs_forbid_extra_keys=True, autoscale=override(omit=True)),
    )
    # a stored replica's launch holds its model entry: one without autoscaling is stored as before it existed
    made.register_unstructure_hook(
        Model,
        make_dict_unstructure_fn(
            Model,
            made,
            autoscale=override(omit=True),
            priority=override(omit_if_default=True),
            idle_after=override(omit_if_default=True),
        ),
    )
    # a stored launch's profile keeps adapters_at_start (what its replica started with); False is left out
    made.register_unstructure_hook(
        Profile, make_dict_unstructure_fn(Profile, made, adapters_at_start=override(omit_if_default=True))
    )
