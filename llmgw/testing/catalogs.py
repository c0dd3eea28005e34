"""Catalogs for tests and benchmarks: sim profiles and models built from named parts, as YAML.

The text is what ``ctl apply`` reads.

A test states only what its catalog is about (its models, a profile's GPUs or flags); the parts every catalog
repeats (``engine: sim``, one GPU, the fast sim's timing) are written here once::

    CATALOG = catalog_yaml({"chat": model("{models}/chat", replicas=2)}, one=sim_profile(1, *FAST_SIM))

A string value may hold ``str.format`` fields (``{models}``): YAML quotes it, and ``.format`` fills it later.
"""

from __future__ import annotations

from collections.abc import Mapping

import yaml

__all__ = [
    "CHAT_CATALOG",
    "FAST_SIM",
    "LOAD_SIM",
    "SMALL_AND_BIG_CATALOG",
    "catalog_yaml",
    "chat_catalog",
    "model",
    "sim_profile",
]

#: sim flags for a fast engine: 20 ms to the first token, then 400 tokens a second
FAST_SIM = ("--time-to-first-token", "0.02", "--tokens-per-second", "400")
#: sim flags for the engines of a test under a :class:`~llmgw.testing.load.GatewayLoad`: 20 ms to the first
#: token, then 40 tokens a second. Each client keeps a request in flight all the same (an answer of 8 tokens
#: takes about 0.2 s), but 16-32 clients no longer send hundreds of requests a second that keep both cores of
#: a CI machine busy and slow down every engine start, ``ctl`` run and test beside it
LOAD_SIM = ("--time-to-first-token", "0.02", "--tokens-per-second", "40")


def sim_profile(
    gpus_per_node: int | None = 1, *args: str, nodes: int | None = None, **fields: object
) -> dict:
    """A profile of the sim engine, called when a test builds its catalog.

    :param gpus_per_node: GPUs of each node (None: leave the field out, as the catalog's default).
    :param args: the sim's flags (left out when none).
    :param nodes: nodes of one replica (None: leave it out, one node).
    :param fields: any other profile field as it is spelled in the catalog (``stop_grace=5``).
    :returns: the profile as the mapping YAML writes.
    """
    profile: dict[str, object] = {"engine": "sim"}
    if nodes is not None:
        profile["nodes"] = nodes
    if gpus_per_node is not None:
        profile["gpus_per_node"] = gpus_per_node
    if args:
        profile["args"] = list(args)
    return profile | fields


def model(
    source: str, profile: str = "one", replicas: int | Mapping[str, object] | None = None, **fields: object
) -> dict:
    """A model of a catalog, called when a test builds its catalog.

    :param source: where the weights are (may hold a ``{models}`` format field).
    :param profile: the profile's name.
    :param replicas: how many replicas, or an autoscaled model's ``{min, max, target...}`` (None: leave it
        out, the catalog's default of one).
    :param fields: any other model field as it is spelled in the catalog (``rollout={"max_surge": 0}``).
    :returns: the model as the mapping YAML writes.
    """
    entry: dict[str, object] = {"source": source, "profile": profile}
    if replicas is not None:
        entry["replicas"] = replicas
    return entry | fields


def catalog_yaml(models: Mapping[str, Mapping], **profiles: Mapping) -> str:
    """The YAML text of a catalog, called by tests and benchmarks for what they apply.

    :param models: model name -> its :func:`model`.
    :param profiles: profile name -> its :func:`sim_profile`; none given: ``one``, the sim on one GPU.
    :returns: the catalog as ``ctl apply`` reads it.
    """
    return yaml.safe_dump(
        {"profiles": profiles or {"one": sim_profile()}, "models": dict(models)}, sort_keys=False
    )


def chat_catalog(replicas: int = 2) -> str:
    """The catalog the gateway's end-to-end tests and benchmarks load: ``replicas`` of ``chat`` on fast sims.

    :returns: its YAML; ``{models}`` stands for the folder of model sources
        (see :func:`llmgw.testing.load.routed_cluster`).
    """
    return catalog_yaml({"chat": model("{models}/chat", replicas=replicas)}, one=sim_profile(1, *FAST_SIM))


#: two replicas of ``chat`` on fast sims (20 ms to the first token, 400 tokens/s)
CHAT_CATALOG = chat_catalog()

#: two replicas of ``small`` on one GPU each and one ``big`` on two nodes of four GPUs (tp4x2): the catalog of
#: the cluster's end-to-end tests, on sqlite and on PostgreSQL; ``{models}`` is the folder of model sources
SMALL_AND_BIG_CATALOG = catalog_yaml(
    {"small": model("{models}/small", replicas=2), "big": model("{models}/big", "tp4x2", replicas=1)},
    one=sim_profile(),
    tp4x2=sim_profile(4, nodes=2),
)
