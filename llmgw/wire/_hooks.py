"""The hooks that make llmgw's one converter strict: scalars of the exact type, lists and mappings as such.

Used by :data:`llmgw.wire.converter` only; every reader of JSON, YAML or
TOML in llmgw goes through that converter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, get_args, get_origin

import cattrs
from cattrs.errors import IterableValidationError, IterableValidationNote
from cattrs.gen import make_mapping_structure_fn

__all__ = ["EXPECTED", "register_strict_scalars", "register_strict_collections"]

#: Why a scalar was refused, by the type expected.
EXPECTED = {
    int: "expected an integer",
    str: "expected a string",
    bool: "expected true or false",
    float: "expected a number",
}


def _got(value: Any) -> str:
    shown = repr(value)
    return f"got {shown}" if len(shown) <= 60 else f"got {shown[:57]}..."


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
