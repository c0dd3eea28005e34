"""The sim's LoRA flags, said once: the plugin spells them in a command, the sim parses them.

vLLM's ``--enable-lora``, ``--max-loras N`` and ``--max-lora-rank R``, and the sim's own
``--lora-load-time SECONDS`` (see :mod:`llmgw_engine_sim.lora` for what the sim does with them). Kept apart
from :mod:`llmgw_engine_sim.lora` so that the plugin, which every llmgw process loads, imports no server.
"""

from __future__ import annotations

import attrs

from llmgw_engine_sim.flags import non_negative, option, positive_int

__all__ = ["LoraOptions"]


@attrs.frozen
class LoraOptions:
    """The LoRA flags."""

    enabled: bool = option(
        False,
        "--enable-lora",
        "serve LoRA adapters, loaded at run time with POST /v1/load_lora_adapter and unloaded with "
        "POST /v1/unload_lora_adapter (vLLM's endpoints); a request names one as its model",
    )
    #: adapters loaded at once (vLLM's "max number of LoRAs in a single batch"; a slot limit in the sim)
    max_loras: int = option(
        1,
        "--max-loras",
        "adapters loaded at once; a load when all N slots are taken answers 409 (vLLM's flag, "
        "a hard slot limit in the sim; default {default})",
        positive_int,
        "N",
    )
    max_lora_rank: int = option(
        16,
        "--max-lora-rank",
        "largest LoRA rank (adapter_config.json's r) a load accepts (default {default})",
        positive_int,
        "R",
    )
    #: seconds a load takes (reading the weights)
    load_time: float = option(
        0.5,
        "--lora-load-time",
        "time one adapter load takes, reading its weights; other requests are served meanwhile "
        "(default {default})",
        non_negative(float),
        "SECONDS",
    )
