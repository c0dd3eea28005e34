"""The agent's --fabric declarations against the adapters it found."""

from __future__ import annotations

import pytest

from llmgw.errors import FabricError
from llmgw.models import Fabric
from llmgw.node.fabric import (
    FabricDeclaration,
    parse_fabric_option,
    resolve_fabric_options,
    resolve_fabrics,
)
from llmgw.testing.fakes import make_adapters

FOUR_ACTIVE = make_adapters({f"mlx5_{i}": "ACTIVE" for i in range(4)})


def resolve(*options: str, adapters=FOUR_ACTIVE, per_fabric: int = 2) -> tuple[Fabric, ...]:
    return resolve_fabric_options(options, adapters, per_fabric)


def refusal(*options: str, adapters=FOUR_ACTIVE) -> str:
    """The message of the FabricError that resolving ``options`` on ``adapters`` must raise."""
    with pytest.raises(FabricError) as info:
        resolve(*options, adapters=adapters)
    return str(info.value)


class TestParse:
    """Reading one --fabric value."""

    def test_name_alone(self) -> None:
        """--fabric ib-b names a fabric and no adapters."""
        assert parse_fabric_option("ib-b") == FabricDeclaration("ib-b", (), "ib-b")

    def test_name_and_adapters(self) -> None:
        """--fabric ib-b:mlx5_2,mlx5_3 keeps the adapters in the order given; spaces are ignored."""
        declaration = parse_fabric_option(" ib-b : mlx5_3 , mlx5_2 ")
        assert (declaration.name, declaration.adapters) == ("ib-b", ("mlx5_3", "mlx5_2"))

    @pytest.mark.parametrize(
        ("text", "says"),
        [
            ("", "empty; expected NAME or NAME:ADAPTER,ADAPTER"),
            ("   ", "empty"),
            ("IB-A", "invalid fabric name 'IB-A'"),
            ("ib a", "invalid fabric name 'ib a'"),
            ("-ib", "invalid fabric name '-ib'"),
            (":mlx5_0", "invalid fabric name ''"),
            ("ib-a:", "no adapter after ':'"),
            ("ib-a:mlx5_0,,mlx5_1", "an empty adapter name"),
            ("ib-a:mlx5_0:mlx5_1", "more than one ':'"),
            ("ib-a:mlx5 0", "invalid adapter name 'mlx5 0'"),
            ("ib-a:mlx5_0,mlx5_0", "adapter mlx5_0 is named twice"),
        ],
    )
    def test_malformed_is_refused_quoting_the_option(self, text: str, says: str) -> None:
        """Each malformed value is refused, quoting --fabric and its text, saying what is wrong."""
        with pytest.raises(FabricError) as info:
            parse_fabric_option(text)
        message = str(info.value)
        assert message.startswith(f"--fabric {text.strip()!r}")
        assert says in message


class TestResolve:
    """Giving each declared fabric its adapters."""

    def test_no_fabric_is_an_island(self) -> None:
        """No --fabric gives no fabrics, whatever the adapters."""
        assert resolve() == ()

    def test_default_takes_two_active_adapters_by_name(self) -> None:
        """--fabric NAME takes the first two ACTIVE adapters by name, skipping inactive ones."""
        adapters = make_adapters(
            {"mlx5_3": "ACTIVE", "mlx5_0": "DOWN", "mlx5_2": "ACTIVE", "mlx5_1": "ACTIVE"}
        )
        assert resolve("ib-a", adapters=adapters) == (Fabric("ib-a", ("mlx5_1", "mlx5_2")),)

    def test_default_count_is_a_parameter(self) -> None:
        """per_fabric sets how many adapters a bare --fabric takes."""
        assert resolve("ib-a", per_fabric=3) == (Fabric("ib-a", ("mlx5_0", "mlx5_1", "mlx5_2")),)

    def test_an_adapter_with_one_active_port_is_active(self) -> None:
        """An adapter counts as active when any of its ports is ACTIVE."""
        adapters = make_adapters({"mlx5_0": ["DOWN", "ACTIVE"], "mlx5_1": "ACTIVE"})
        assert resolve("ib-a", adapters=adapters) == (Fabric("ib-a", ("mlx5_0", "mlx5_1")),)

    def test_named_adapters_are_taken_as_given(self) -> None:
        """Named adapters are used in the order given, however many."""
        fabrics = resolve("ib-a:mlx5_3", "ib-b:mlx5_2,mlx5_0,mlx5_1")
        assert fabrics == (Fabric("ib-a", ("mlx5_3",)), Fabric("ib-b", ("mlx5_2", "mlx5_0", "mlx5_1")))

    def test_a_bare_fabric_takes_what_others_did_not_name(self) -> None:
        """Beside a fabric with named adapters, a bare one takes from the rest only."""
        fabrics = resolve("ib-b", "ib-a:mlx5_0,mlx5_2")
        assert fabrics == (Fabric("ib-b", ("mlx5_1", "mlx5_3")), Fabric("ib-a", ("mlx5_0", "mlx5_2")))

    def test_per_fabric_below_one_is_a_bug(self) -> None:
        """per_fabric=0 is a programming error, not an operator one."""
        with pytest.raises(ValueError, match="per_fabric must be >= 1"):
            resolve("ib-a", per_fabric=0)


class TestRefusals:
    """Every refusal names the fabric or adapter, says why and what to do."""

    def test_adapter_under_two_fabrics(self) -> None:
        """One adapter under two fabrics is refused, naming it and both fabrics."""
        message = refusal("ib-a:mlx5_0,mlx5_1", "ib-b:mlx5_2,mlx5_0")
        assert message.startswith(
            "adapter mlx5_0 is named under two fabrics: ib-a and ib-b; an adapter belongs to one fabric"
        )

    def test_missing_adapter_lists_the_ones_there_are(self) -> None:
        """An adapter the node does not have is refused, listing the adapters it has."""
        adapters = make_adapters({"mlx5_0": "ACTIVE", "mlx5_1": "DOWN"})
        message = refusal("ib-b:mlx5_0,mlx5_9", adapters=adapters)
        assert message.startswith("--fabric ib-b: adapter mlx5_9 does not exist on this node")
        assert "adapters there are: mlx5_0 (ACTIVE), mlx5_1 (DOWN)" in message

    def test_inactive_adapter_says_its_port_state(self) -> None:
        """A named adapter with no ACTIVE port is refused with its port's state."""
        adapters = make_adapters({"mlx5_2": "ACTIVE", "mlx5_3": "DOWN"})
        message = refusal("ib-b:mlx5_2,mlx5_3", adapters=adapters)
        assert message == (
            "--fabric ib-b: adapter mlx5_3 is DOWN (port 1); name active adapters or bring the port up"
        )

    def test_inactive_multi_port_adapter_lists_every_port(self) -> None:
        """With several ports, every port's state is shown."""
        adapters = make_adapters({"mlx5_0": ["DOWN", "INIT"]})
        with pytest.raises(FabricError, match=r"mlx5_0 has no ACTIVE port \(port 1 DOWN, port 2 INIT\)"):
            resolve("ib-a:mlx5_0", adapters=adapters)

    def test_too_few_active_adapters(self) -> None:
        """A bare fabric with one active adapter is refused, naming what is down and a fix."""
        adapters = make_adapters({"mlx5_0": "ACTIVE", "mlx5_1": "DOWN"})
        message = refusal("ib-a", adapters=adapters)
        assert message.startswith("--fabric ib-a needs 2 active adapters but only 1 free: mlx5_0")
        assert "mlx5_1 is DOWN (port 1)" in message
        assert "--fabric ib-a:mlx5_0" in message

    def test_too_few_counts_adapters_other_fabrics_took(self) -> None:
        """Adapters named under another fabric are not free, and the message says where they went."""
        adapters = make_adapters({"mlx5_0": "ACTIVE", "mlx5_1": "ACTIVE", "mlx5_2": "ACTIVE"})
        message = refusal("ib-a:mlx5_0,mlx5_1", "ib-b", adapters=adapters)
        assert message.startswith("--fabric ib-b needs 2 active adapters but only 1 free: mlx5_2")
        assert "mlx5_0 is under fabric ib-a" in message

    def test_no_adapters_at_all(self) -> None:
        """A fabric on a node with no RDMA adapter is refused, saying the node would be an island."""
        with pytest.raises(FabricError, match="--fabric ib-a needs 2 active adapters .* no RDMA"):
            resolve("ib-a", adapters=[])

    def test_two_bare_fabrics_are_not_guessed(self) -> None:
        """Two fabrics naming no adapters are refused even with enough adapters, with an example."""
        message = refusal("ib-a", "ib-b")
        assert message.startswith("--fabric ib-a and --fabric ib-b name no adapters")
        assert "--fabric ib-a:mlx5_0,mlx5_1 --fabric ib-b:mlx5_2,mlx5_3" in message

    def test_fabric_declared_twice(self) -> None:
        """The same fabric named twice is refused, quoting both options."""
        message = refusal("ib-a:mlx5_0", "ib-a:mlx5_1")
        assert message.startswith(
            "fabric ib-a is declared twice (--fabric ib-a:mlx5_0 and --fabric ib-a:mlx5_1)"
        )

    def test_duplicate_in_a_hand_built_declaration(self) -> None:
        """A declaration built in code with one adapter twice is refused too."""
        declaration = FabricDeclaration("ib-a", ("mlx5_0", "mlx5_0"))
        with pytest.raises(FabricError, match="--fabric ib-a: adapter mlx5_0 is named twice"):
            resolve_fabrics([declaration], FOUR_ACTIVE)
