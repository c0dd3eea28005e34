"""Reading llama.cpp's own help format: ``llama-server --help`` and the RPC worker's.

An option is defined on a line starting at column 0 (``llama-server``) or
slightly indented (the RPC worker), its spellings first, then the description
from a fixed column on, continued on deeper-indented lines::

    -fa,   --flash-attn [on|off|auto]       set Flash Attention use (...)
    -ngl,  --gpu-layers, --n-gpu-layers N   max. number of layers to store in VRAM, ...
    --draft, --draft-n, --draft-max N       the argument has been removed. use ...
      -d DEV,  --device         device to use

A flag whose description says "the argument has been removed" is listed but
no longer accepted: it is not documented.
"""

from __future__ import annotations

import re

__all__ = ["REMOVED", "parse_llamacpp_help"]

#: what llama.cpp says of a flag it still lists but no longer takes
REMOVED = "the argument has been removed"

_DEFINITION = re.compile(r"^( {0,8})(-[A-Za-z0-9-].*)$")
_SPELLING = re.compile(r"^(--?[A-Za-z0-9][A-Za-z0-9_.-]*)")
_TOKEN = re.compile(r"(\S+)(\s*)")


def _spellings(definition: str) -> tuple[list[str], str]:
    """Split an option line into its spellings and the start of its description.

    The spellings and metavars end at the first gap of two or more spaces
    that does not follow a comma (``-ngl,  --gpu-layers`` continues,
    ``N   max. number`` ends).
    """
    spellings: list[str] = []
    for match in _TOKEN.finditer(definition):
        token, gap = match.groups()
        for part in token.split("/"):
            spelling = _SPELLING.match(part)
            if spelling and part.startswith("-"):
                spellings.append(spelling.group(1))
        if len(gap) >= 2 and not token.endswith(","):
            return spellings, definition[match.end() :]
    return spellings, ""


def parse_llamacpp_help(text: str) -> frozenset[str]:
    """The flags a llama.cpp help documents: long and short forms, without removed ones.

    Only an option's own definition line counts; a flag mentioned in another
    option's description, or in a section title, is not documented by it.
    """
    flags: set[str] = set()
    block: tuple[list[str], list[str]] | None = None
    blocks: list[tuple[list[str], list[str]]] = []
    for line in text.splitlines():
        definition = _DEFINITION.match(line)
        if definition and not line.lstrip().startswith("---"):
            spellings, description = _spellings(definition.group(2))
            block = (spellings, [description])
            blocks.append(block)
        elif block is not None and line.startswith(" " * 9) and line.strip():
            block[1].append(line.strip())
        else:
            block = None
    for spellings, description in blocks:
        if REMOVED not in " ".join(description).lower():
            flags.update(spellings)
    return frozenset(flags)
