"""The agent's ``--fabric`` declarations, checked against the adapters it found.

A node declares the fabrics it is on; nothing is guessed (OpenSM's default
subnet prefix is the same on every fabric). ``--fabric ib-a`` takes
``per_fabric`` (default 2) ACTIVE adapters, the first by name;
``--fabric ib-a:mlx5_0,mlx5_1`` takes exactly those. Every refusal is a
:class:`~llmgw.errors.FabricError` that names the fabric or adapter, says why,
and what to do.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import attrs

from llmgw.errors import FabricError
from llmgw.models import Adapter, Fabric

__all__ = [
    "DEFAULT_ADAPTERS_PER_FABRIC",
    "FabricDeclaration",
    "parse_fabric_option",
    "resolve_fabrics",
    "resolve_fabric_options",
]

#: How many ACTIVE adapters a ``--fabric NAME`` without adapters takes.
DEFAULT_ADAPTERS_PER_FABRIC = 2

_FABRIC_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SYNTAX = "expected NAME or NAME:ADAPTER,ADAPTER (e.g. --fabric ib-a or --fabric ib-a:mlx5_0,mlx5_1)"


@attrs.frozen
class FabricDeclaration:
    """One ``--fabric`` option as parsed, before it meets the node's adapters."""

    name: str
    #: adapters named after ``:``; empty means "take the default number"
    adapters: tuple[str, ...] = attrs.field(converter=tuple, default=())
    #: the option's text as given, for messages
    text: str = ""


def parse_fabric_option(text: str) -> FabricDeclaration:
    """Parse one ``--fabric`` value: ``NAME`` or ``NAME:ADAPTER,ADAPTER...``.

    Called by the agent (and ``llmgw discover``) for each ``--fabric``, before
    discovery. Fabric names are lowercase letters, digits, ``.``, ``_`` and
    ``-``, starting with a letter or digit; spaces around names are ignored.

    :returns: a :class:`FabricDeclaration`.
    :raises FabricError: on an empty or invalid name, an empty adapter list or
        item, a second ``:``, or an adapter named twice in the option.
    """
    raw = text.strip()
    if not raw:
        raise FabricError(f"--fabric {raw!r}: empty; {_SYNTAX}")
    name, colon, rest = (part.strip() for part in raw.partition(":"))
    if not _FABRIC_NAME.match(name):
        raise FabricError(
            f"--fabric {raw!r}: invalid fabric name {name!r}; use lowercase letters, digits, "
            "'.', '_' and '-', starting with a letter or digit (e.g. ib-a)"
        )
    if not colon:
        return FabricDeclaration(name=name, text=raw)
    if ":" in rest:
        raise FabricError(f"--fabric {raw!r}: more than one ':'; {_SYNTAX}")
    if not rest:
        raise FabricError(
            f"--fabric {raw!r}: no adapter after ':'; write --fabric {name} to take "
            f"{DEFAULT_ADAPTERS_PER_FABRIC} active adapters, or --fabric {name}:mlx5_0,mlx5_1"
        )
    adapters = [item.strip() for item in rest.split(",")]
    for item in adapters:
        if not item:
            raise FabricError(f"--fabric {raw!r}: an empty adapter name between commas; {_SYNTAX}")
        if not _ADAPTER_NAME.match(item):
            raise FabricError(
                f"--fabric {raw!r}: invalid adapter name {item!r}; adapter names are as under "
                "/sys/class/infiniband (e.g. mlx5_0)"
            )
        if adapters.count(item) > 1:
            raise FabricError(f"--fabric {raw!r}: adapter {item} is named twice; name it once")
    return FabricDeclaration(name=name, adapters=adapters, text=raw)


def resolve_fabrics(
    declarations: Sequence[FabricDeclaration],
    adapters: Sequence[Adapter],
    per_fabric: int = DEFAULT_ADAPTERS_PER_FABRIC,
) -> tuple[Fabric, ...]:
    """Give each declared fabric its adapters, or refuse.

    Called by the agent at start, after adapter discovery. A declaration that
    names adapters gets exactly those; one that names none gets the first
    ``per_fabric`` ACTIVE adapters by name that no other fabric named. At most
    one declaration may name none: with two, which adapter is on which fabric
    cannot be known, so it is refused rather than guessed.

    :returns: one :class:`Fabric` per declaration, in declaration order; an
        empty tuple for no declarations (an island node).
    :raises FabricError: a fabric declared twice; an adapter under two
        fabrics; an adapter that does not exist or has no ACTIVE port; several
        fabrics naming no adapters; fewer free ACTIVE adapters than needed.
    """
    if per_fabric < 1:
        raise ValueError(f"per_fabric must be >= 1, got {per_fabric}")
    by_name: dict[str, Adapter] = {}
    for adapter in adapters:
        by_name.setdefault(adapter.name, adapter)
    _refuse_twice_declared(declarations)
    owner = _owners(declarations)
    for declaration in declarations:
        for name in declaration.adapters:
            _check_named(declaration, by_name.get(name), name, by_name)
    bare = [d for d in declarations if not d.adapters]
    free = sorted(a.name for a in by_name.values() if a.active and a.name not in owner)
    if len(bare) > 1:
        raise FabricError(_ambiguous(bare, free, per_fabric))
    fabrics = []
    for declaration in declarations:
        chosen = declaration.adapters
        if not chosen:
            if len(free) < per_fabric:
                raise FabricError(_too_few(declaration, free, owner, by_name, per_fabric))
            chosen = tuple(free[:per_fabric])
        fabrics.append(Fabric(name=declaration.name, adapters=chosen))
    return tuple(fabrics)


def resolve_fabric_options(
    options: Iterable[str],
    adapters: Sequence[Adapter],
    per_fabric: int = DEFAULT_ADAPTERS_PER_FABRIC,
) -> tuple[Fabric, ...]:
    """Parse every ``--fabric`` text and resolve them, as the agent does at start.

    :returns: what :func:`resolve_fabrics` returns.
    :raises FabricError: as :func:`parse_fabric_option` and :func:`resolve_fabrics`.
    """
    declarations = [parse_fabric_option(text) for text in options]
    return resolve_fabrics(declarations, adapters, per_fabric)


def _refuse_twice_declared(declarations: Sequence[FabricDeclaration]) -> None:
    seen: dict[str, FabricDeclaration] = {}
    for declaration in declarations:
        first = seen.setdefault(declaration.name, declaration)
        if first is not declaration:
            raise FabricError(
                f"fabric {declaration.name} is declared twice (--fabric {first.text or first.name} "
                f"and --fabric {declaration.text or declaration.name}); declare each fabric once, "
                f"with all its adapters: --fabric {declaration.name}:ADAPTER,ADAPTER"
            )


def _owners(declarations: Sequence[FabricDeclaration]) -> dict[str, str]:
    owner: dict[str, str] = {}
    for declaration in declarations:
        for name in declaration.adapters:
            first = owner.setdefault(name, declaration.name)
            if first == declaration.name and declaration.adapters.count(name) > 1:
                raise FabricError(
                    f"--fabric {declaration.name}: adapter {name} is named twice; name it once"
                )
            if first != declaration.name:
                raise FabricError(
                    f"adapter {name} is named under two fabrics: {first} and {declaration.name}; "
                    "an adapter belongs to one fabric: name it under one --fabric only"
                )
    return owner


def _check_named(
    declaration: FabricDeclaration, adapter: Adapter | None, name: str, by_name: dict[str, Adapter]
) -> None:
    if adapter is None:
        raise FabricError(
            f"--fabric {declaration.name}: adapter {name} does not exist on this node; "
            f"adapters there are: {_listing(by_name)}; name one of those"
        )
    if not adapter.active:
        raise FabricError(
            f"--fabric {declaration.name}: adapter {name} {_inactive(adapter)}; "
            "name active adapters or bring the port up"
        )


def _listing(by_name: dict[str, Adapter]) -> str:
    if not by_name:
        return "none (discovery found no RDMA adapter)"
    return ", ".join(f"{name} ({_state(by_name[name])})" for name in sorted(by_name))


def _state(adapter: Adapter) -> str:
    if adapter.active:
        return "ACTIVE"
    return "/".join(port.state for port in adapter.ports) or "no ports"


def _inactive(adapter: Adapter) -> str:
    if not adapter.ports:
        return "has no ports"
    if len(adapter.ports) == 1:
        port = adapter.ports[0]
        return f"is {port.state} (port {port.number})"
    states = ", ".join(f"port {p.number} {p.state}" for p in adapter.ports)
    return f"has no ACTIVE port ({states})"


def _ambiguous(bare: list[FabricDeclaration], free: list[str], per_fabric: int) -> str:
    names = " and ".join(f"--fabric {d.name}" for d in bare)
    suggestion = []
    for i, declaration in enumerate(bare):
        chunk = free[i * per_fabric : (i + 1) * per_fabric]
        chunk += ["ADAPTER"] * (per_fabric - len(chunk))
        suggestion.append(f"--fabric {declaration.name}:{','.join(chunk)}")
    return (
        f"{names} name no adapters, and which adapters are on which fabric cannot be guessed "
        "(every fabric's subnet manager may use the same default subnet prefix); "
        f"name each fabric's adapters, e.g. {' '.join(suggestion)}"
    )


def _too_few(
    declaration: FabricDeclaration,
    free: list[str],
    owner: dict[str, str],
    by_name: dict[str, Adapter],
    per_fabric: int,
) -> str:
    name = declaration.name
    if not by_name:
        return (
            f"--fabric {name} needs {per_fabric} active adapters but this node has no RDMA "
            "adapter; a node on no fabric is an island: drop --fabric, or check --ib-root"
        )
    have = f"only {len(free)} free: {', '.join(free)}" if free else "none is free"
    details = [
        f"{a.name} {_inactive(a)}" for a in sorted(by_name.values(), key=lambda a: a.name)
        if not a.active
    ]
    details += [f"{a} is under fabric {f}" for a, f in sorted(owner.items())]
    why = f" ({'; '.join(details)})" if details else ""
    hint = f"--fabric {name}:{','.join(free)}" if free else f"--fabric {name}:ADAPTER"
    return (
        f"--fabric {name} needs {per_fabric} active adapters but {have}{why}; "
        f"bring ports up, or name the adapters this fabric uses: {hint}"
    )
