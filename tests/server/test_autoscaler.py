"""The autoscaler's decisions: up fast, down after a sustained low, cooldown, max step, min and max."""

from __future__ import annotations

import attrs
import pytest

from llmgw.models import Autoscale, Catalog, Model, Profile, ScaleTarget
from llmgw.scheduler import Replica, Unplaced
from llmgw.server.controllers.autoscaler import decide, give_way, recommend, step
from llmgw.server.state.autoscale import Demand, ScaleBook, ScaleCause, ScaleDirection, ScaleMemory
from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import EventKind, ReplicaState
from llmgw.wire import GatewayActivity, ModelActivity, ShardLoad

UP, HOLD = ScaleDirection.UP, ScaleDirection.HOLD
POLICY = Autoscale(
    min=1, max=5, target=ScaleTarget(waiting_per_replica=4), scale_down_after=30, cooldown=10, max_step=2
)


class Run:
    """One model's decisions over a fake clock: each :meth:`at` is a reconcile pass at that second."""

    def __init__(self, policy: Autoscale = POLICY, desired: int = 2) -> None:
        self.policy = policy
        self.book = ScaleBook()
        self.memory = ScaleMemory(desired)

    def at(self, now: float, waiting: float | None, ready: int | None = None):
        """A pass at ``now`` seeing ``waiting`` per replica (None: no signal) from ``ready`` replicas."""
        values = {} if waiting is None else {"waiting_per_replica": waiting}
        ready = self.memory.desired if ready is None else ready
        decision, memory = decide("chat", self.policy, self.memory, ready, values, now)
        self.book.keep(decision, memory)  # as the state's verb does: it remembers the last change
        self.memory = self.book.models["chat"]
        return decision


class TestUp:
    """Over target, replicas are added at once, within max_step, max and the cooldown."""

    def test_over_target_scales_up_at_once_and_says_why(self):
        """7.5 waiting per replica on 2 replicas with a target of 4 asks for 4, in one pass."""
        decision = Run().at(100, 7.5)
        assert (decision.direction, decision.cause, decision.after) == (
            ScaleDirection.UP,
            ScaleCause.OVER_TARGET,
            4,
        )
        assert decision.describe() == "2 → 4: 7.5 waiting per replica > target 4"

    def test_max_step_limits_one_decision(self):
        """Asking for 6 from 2 with max_step 2 gives 4."""
        assert Run().at(100, 12).after == 4

    def test_cooldown_holds_the_next_change(self):
        """A second rise within the cooldown holds; after it, the next step goes."""
        run = Run()
        assert run.at(100, 7.5).after == 4
        held = run.at(105, 7.5, ready=4)
        assert (held.direction, held.cause, held.after) == (ScaleDirection.HOLD, ScaleCause.COOLDOWN, 4)
        assert run.at(111, 7.5, ready=4).after == 5  # capped at max

    def test_at_max_holds_and_says_so(self):
        """Over target at max: a hold whose cause is at-max."""
        run = Run(desired=5)
        decision = run.at(100, 9)
        assert (decision.direction, decision.cause, decision.after) == (
            ScaleDirection.HOLD,
            ScaleCause.AT_MAX,
            5,
        )

    def test_new_replicas_not_ready_do_not_compound(self):
        """While the replicas asked for start, the same queue on the same ready replicas asks for no more."""
        run = Run()
        assert run.at(100, 8).after == 4
        assert run.at(120, 8, ready=2).after == 4


class TestNoFlapping:
    """At most one change of direction per stabilization window; one reading does not scale up."""

    def test_a_step_down_is_not_undone_within_the_window(self):
        """Down at 130; over target at 135 and 159 holds (stabilizing, saying when it scaled down); at 160,
        a whole window after the step down, up."""
        run = Run(desired=4)
        run.at(100, 0)
        assert run.at(130, 0).after == 2
        held = run.at(135, 7)
        assert (held.direction, held.cause, held.after) == (HOLD, ScaleCause.STABILIZING, 2)
        said = "stays at 2: 7 waiting per replica > target 4 (stabilizing: scaled down 5 s ago)"
        assert held.describe() == said
        assert run.at(159, 7).direction == HOLD
        up = run.at(160, 7)
        assert (up.direction, up.cause, up.after) == (UP, ScaleCause.OVER_TARGET, 4)

    def test_a_step_up_may_follow_another_at_once(self):
        """Up then up again after the cooldown: no change of direction, no wait for the window."""
        run = Run()
        assert run.at(100, 7.5).after == 4
        assert run.at(110, 6, ready=4).after == 5

    def test_a_wake_is_never_held_by_the_window(self):
        """A model put to sleep at 20 wakes at 21 for a held request: requests wait on it."""
        policy = Autoscale(min=0, max=2, target=ScaleTarget(4), scale_down_after=30, cooldown=10)
        memory = ScaleMemory(1, changed_at=0)
        slept, memory = decide("chat", policy, memory, 1, {}, 20, idle_after=10, demand=Demand(since=0))
        assert (slept.direction, slept.after) == (ScaleDirection.DOWN, 0)
        memory = attrs.evolve(memory, last_change=slept)
        woke, _ = decide(
            "chat", policy, memory, 0, {}, 21, idle_after=10, demand=Demand(since=0, held=1, held_at=21)
        )
        assert (woke.direction, woke.cause, woke.after) == (UP, ScaleCause.WAKE, 1)

    def test_a_step_down_leaves_headroom_under_the_target(self):
        """2.5 waiting on 4 replicas (target 4): 3 would carry 3.33 each, over 80% of the target: no step
        down; 2 waiting: 3 carry 2.67, under it: down to 3."""
        policy = Autoscale(min=1, max=5, target=ScaleTarget(4), scale_down_after=30, max_step=2)
        run = Run(policy, desired=4)
        run.at(100, 2.5)
        held = run.at(130, 2.5)
        assert (held.direction, held.cause, held.after) == (HOLD, ScaleCause.AT_TARGET, 4)
        run.at(140, 2)
        down = run.at(170, 2)
        assert (down.direction, down.after) == (ScaleDirection.DOWN, 3)


class TestDown:
    """Under target, replicas are stopped only after a sustained low."""

    def test_down_only_after_the_window(self):
        """A low for less than scale_down_after holds; once it lasted the window, one step down."""
        run = Run(desired=4)
        for now in (100, 110, 120):
            held = run.at(now, 0)
            assert (held.direction, held.cause) == (ScaleDirection.HOLD, ScaleCause.STABILIZING)
        down = run.at(130, 0)
        assert (down.direction, down.cause, down.after) == (ScaleDirection.DOWN, ScaleCause.UNDER_TARGET, 2)
        assert down.describe() == "4 → 2: 0 waiting per replica < target 4 for 30 s"

    def test_a_spike_in_the_window_restarts_it(self):
        """A pass at or over target inside the window starts the window again."""
        run = Run(desired=3)
        run.at(100, 0)
        run.at(120, 4)  # at target: no longer low
        assert run.at(140, 0).cause == ScaleCause.STABILIZING
        assert run.at(170, 0).direction == ScaleDirection.DOWN

    def test_down_goes_no_lower_than_the_highest_recommendation_of_the_window(self):
        """Lows of 3 then 1 replicas' worth over the window scale 4 down to 3, not 1."""
        run = Run(
            policy=Autoscale(min=1, max=5, target=ScaleTarget(4), scale_down_after=30, max_step=4), desired=4
        )
        run.at(100, 2)  # ceil(4 * 2 / (4 * DOWN_HEADROOM)) = 3
        run.at(115, 0)
        assert run.at(130, 0).after == 3

    def test_each_step_down_needs_its_own_window(self):
        """After a step down, the next one waits a whole window again (its replicas changed meanwhile)."""
        run = Run(
            policy=Autoscale(min=1, max=5, target=ScaleTarget(4), scale_down_after=30, max_step=1), desired=3
        )
        run.at(100, 0)
        assert run.at(130, 0).after == 2
        for now in (131, 145, 160):
            assert run.at(now, 0).cause == ScaleCause.STABILIZING
        assert run.at(161, 0).after == 1

    def test_never_below_min(self):
        """No load at min holds at min."""
        run = Run(desired=1)
        for now in (0, 40, 80):
            assert run.at(now, 0).after == 1


class TestInputs:
    """Bounds, missing signals, several targets."""

    def test_no_signal_holds(self):
        """No ready replica reported: nothing changes, and the cause says why."""
        decision = Run().at(100, None)
        assert (decision.direction, decision.cause) == (ScaleDirection.HOLD, ScaleCause.NO_SIGNAL)
        assert decision.describe() == "stays at 2: no signal"

    def test_desired_outside_new_bounds_is_clamped_at_once(self):
        """A catalog whose min rose above the desired count scales up to it without waiting."""
        run = Run(policy=Autoscale(min=3, max=5, target=ScaleTarget(4)), desired=2)
        decision = run.at(100, 0)
        assert (decision.direction, decision.cause, decision.after) == (
            ScaleDirection.UP,
            ScaleCause.BOUNDS,
            3,
        )

    @pytest.mark.parametrize(
        ("values", "expected"),
        [
            ({"waiting_per_replica": 4.2}, (2, "waiting_per_replica")),  # within the tolerance
            ({"waiting_per_replica": 8, "kv_cache_usage": 0.4}, (4, "waiting_per_replica")),
            ({"waiting_per_replica": 0, "kv_cache_usage": 0.9}, (3, "kv_cache_usage")),
            ({}, None),
        ],
    )
    def test_the_most_demanding_target_decides(self, values, expected):
        """Each signal asks for ceil(ready × value / target); the largest wins."""
        assert recommend(ScaleTarget(waiting_per_replica=4, kv_cache_usage=0.6), 2, values) == expected


class TestBook:
    """What the state keeps of the decisions."""

    def test_only_changes_and_the_first_hold_at_max_are_events(self):
        """Holds are not events, but the first at max is; a second one is not."""
        book, run = ScaleBook(), Run(desired=5)
        first = run.at(100, 9)
        assert book.keep(first, run.memory)
        assert not book.keep(run.at(101, 9), run.memory)
        run2 = Run()
        assert book.keep(run2.at(100, 8), run2.memory)
        assert not book.keep(run2.at(101, 4, ready=4), run2.memory)


class TestInTheState:
    """The controller on a real cluster state: the scheduler's catalog, the events, what is forgotten."""

    def test_desired_count_reaches_the_scheduler_and_the_events(self):
        """Loads over target make the scheduler's catalog ask for more; the change is an autoscale event."""
        auto = Autoscale(min=1, max=4, target=ScaleTarget(waiting_per_replica=2), cooldown=0)
        catalog = Catalog({"one": Profile(engine="sim")}, {"chat": Model("/m", "one", 1, autoscale=auto)})
        state = ClusterState()
        state.apply_catalog(catalog, "", 0)
        record = state.place(Replica("chat-0", "chat", 0, ()), None, 0, "placed")
        state.mark_ready(record, 1)
        assert record.state == ReplicaState.READY
        assert state.scaled_catalog().models["chat"].replicas == 1
        state.autoscale.record_loads([ShardLoad("chat-0", record.attempt, waiting=6)], 10)
        step(state, 10)
        assert state.scaled_catalog().models["chat"].replicas == 3
        assert state.schedule_wanted
        events = [e for e in state.take_events() if e.kind == EventKind.AUTOSCALE]
        assert [(e.subject, e.message) for e in events] == [
            ("chat", "1 → 3: 6 waiting per replica > target 2")
        ]
        state.remove("chat-0", 11, None)
        assert "chat-0" not in state.autoscale.loads
        state.apply_catalog(Catalog(catalog.profiles, {"chat": Model("/m", "one", 2)}), "", 12)
        assert state.autoscale.models == {} and state.scaled_catalog().models["chat"].replicas == 2


ZERO = Autoscale(min=0, max=3, target=ScaleTarget(waiting_per_replica=4), cooldown=10, scale_down_after=30)


def zero_catalog(idle_after: float = 60) -> Catalog:
    """One model ``chat`` (served as ``chat-v1``) that may go to zero after ``idle_after`` seconds."""
    model = Model("/m", "one", 0, served_name="chat-v1", autoscale=ZERO, idle_after=idle_after)
    return Catalog({"one": Profile(engine="sim")}, {"chat": model})


class TestScaleToZero:
    """A model whose min is 0: to zero after idle_after without a request, back to one on a request."""

    def at(self, memory: ScaleMemory, demand: Demand, now: float, waiting: float | None = None):
        values = {} if waiting is None else {"waiting_per_replica": waiting}
        return decide("chat", ZERO, memory, memory.desired, values, now, idle_after=60, demand=demand)

    def test_idle_for_idle_after_goes_to_zero_and_says_why(self):
        """The last request at 100: still one replica at 159, none at 160."""
        demand = Demand(since=0, last_request=100)
        memory = ScaleMemory(1, changed_at=0)
        assert self.at(memory, demand, 159)[0].direction == HOLD
        decision, memory = self.at(memory, demand, 160)
        assert (decision.after, decision.cause, memory.desired) == (0, ScaleCause.IDLE, 0)
        assert decision.describe() == "1 → 0: idle: no request for 60 s (idle_after 60)"

    def test_signals_alone_never_take_it_to_zero(self):
        """No waiting request for the whole window, a request 10 s ago: down to one, not zero."""
        memory = ScaleMemory(2, changed_at=0)
        demand = Demand(since=0, last_request=990)
        decision, memory = self.at(memory, demand, 1000, waiting=0)
        decision, memory = self.at(memory, demand, 1031, waiting=0)
        assert (decision.cause, decision.after) == (ScaleCause.UNDER_TARGET, 1)

    def test_a_request_wakes_it_at_once_even_in_the_cooldown(self):
        """At zero since 200: a request reported at 201 asks for one replica in the same pass."""
        memory = ScaleMemory(0, changed_at=200)
        assert self.at(memory, Demand(since=0, last_request=150), 201)[0].cause == ScaleCause.IDLE
        decision, memory = self.at(memory, Demand(since=0, last_request=201, held=3, held_at=201), 201)
        assert (decision.direction, decision.cause, memory.desired) == (UP, ScaleCause.WAKE, 1)
        assert decision.describe() == "0 → 1: woken: 3 requests held at the gateways"

    def test_requests_held_before_it_slept_do_not_wake_it(self):
        """Held at 95 (then served), asleep at 200: the stale count of held requests wakes nothing."""
        demand = Demand(since=0, last_request=100, held=4, held_at=195)
        assert self.at(ScaleMemory(0, changed_at=200), demand, 201)[0].cause == ScaleCause.IDLE

    def test_a_server_that_starts_does_not_put_models_to_sleep_at_once(self):
        """A leader that starts knows of no request: idle counts from when it started deciding."""
        demand = Demand(since=1000)
        memory = ScaleMemory(1)
        assert self.at(memory, demand, 1059)[0].direction == HOLD
        assert self.at(memory, demand, 1060)[0].cause == ScaleCause.IDLE

    def test_a_request_before_the_server_started_does_not_wake_it(self):
        """A gateway says its last request was long ago: no wake for a model already at zero."""
        demand = Demand(since=1000, last_request=400)
        assert self.at(ScaleMemory(0), demand, 1001)[0].cause == ScaleCause.IDLE

    def test_the_gateways_report_reaches_the_decision_by_served_name(self):
        """`POST /v1/gateway/activity` with a held request for `chat-v1` wakes `chat` in the next pass;
        the routes feed names it as waking on demand."""
        from llmgw.server.views.cluster import route_table

        state = ClusterState()
        state.apply_catalog(zero_catalog(), "", 0)
        step(state, 1)
        assert state.scaled_catalog().models["chat"].replicas == 0
        assert route_table(state).wake_on_demand == ("chat-v1",)
        report = GatewayActivity((ModelActivity("chat-v1", idle=0.0, held=2), ModelActivity("other", 1)))
        assert state.note_activity(report, 5)
        step(state, 5)
        assert state.scaled_catalog().models["chat"].replicas == 1
        events = [e.message for e in state.take_events() if e.kind == EventKind.AUTOSCALE]
        assert events == ["0 → 1: woken: 2 requests held at the gateways"]


class TestTimeToFirstToken:
    """A `ttft_p95` target reads what the gateways measure on streams."""

    def test_the_worst_recent_gateway_report_scales_up(self):
        """Two gateway processes report 0.4 s and 1.2 s against a target of 0.5 s on 2 replicas: 5, within
        max_step (4); a report older than 15 s no longer counts."""
        auto = Autoscale(min=1, max=6, target=ScaleTarget(ttft_p95=0.5), cooldown=0)
        catalog = Catalog({"one": Profile(engine="sim")}, {"chat": Model("/m", "one", 2, autoscale=auto)})
        state = ClusterState()
        state.apply_catalog(catalog, "", 0)
        for index in range(2):
            state.mark_ready(state.place(Replica(f"chat-{index}", "chat", index, ()), None, 0, "placed"), 1)
        state.note_activity(GatewayActivity((ModelActivity("chat", ttft_p95=0.4, streams=30),)), 10)
        state.note_activity(GatewayActivity((ModelActivity("chat", ttft_p95=1.2, streams=20),)), 11)
        ready, values = state.autoscale.signals(auto.target, state.replicas.values(), 12, "chat")
        assert (ready, values) == (2, {"ttft_p95": 1.2})
        assert state.autoscale.signals(auto.target, state.replicas.values(), 27, "chat")[1] == {}
        step(state, 12)
        assert state.scaled_catalog().models["chat"].replicas == 4
        events = [e.message for e in state.take_events() if e.kind == EventKind.AUTOSCALE]
        assert events == ["2 → 4: 1.2 s time to first token (p95) > target 0.5"]


class TestGiveWay:
    """When the fleet is full, a lower-priority model gives a replica to a higher-priority one."""

    @staticmethod
    def models(**desired_and_priority: tuple[int, int]) -> dict[str, tuple[Model, ScaleMemory]]:
        """Autoscaled models (min 1, max 8, cooldown 10): name -> (desired, priority)."""
        auto = Autoscale(min=1, max=8, target=ScaleTarget(4), cooldown=10)
        return {
            name: (Model("/m", "one", 1, autoscale=auto, priority=priority), ScaleMemory(desired))
            for name, (desired, priority) in desired_and_priority.items()
        }

    def test_lowest_priority_gives_one_and_says_to_whom(self):
        """chat (10) starves: batch (0) gives one before docs (5); the event names both priorities."""
        given = give_way(self.models(chat=(3, 10), docs=(3, 5), batch=(2, 0)), {"chat"}, 100)
        assert given is not None
        decision, memory = given
        assert (decision.model, decision.before, decision.after, decision.cause) == (
            "batch", 2, 1, ScaleCause.GIVE_WAY
        )  # fmt: skip
        assert decision.describe() == "2 → 1: gives way to chat (priority 10 > 0): the fleet is full"
        assert (memory.desired, memory.changed_at) == (1, 100)

    def test_never_below_min_nor_to_an_equal_or_lower_priority(self):
        """A model at its min, or of the same priority, gives nothing."""
        assert give_way(self.models(chat=(3, 10), batch=(1, 0)), {"chat"}, 100) is None
        assert give_way(self.models(chat=(3, 10), peer=(4, 10)), {"chat"}, 100) is None
        assert give_way(self.models(chat=(3, 0), batch=(4, 10)), {"chat"}, 100) is None

    def test_a_giver_in_its_cooldown_waits(self):
        """A model that changed less than its cooldown ago gives nothing yet."""
        models = self.models(chat=(3, 10), batch=(4, 0))
        model, memory = models["batch"]
        models["batch"] = (model, ScaleMemory(4, changed_at=95))
        assert give_way(models, {"chat"}, 100) is None
        assert give_way(models, {"chat"}, 105) is not None

    def test_lower_priority_does_not_scale_up_while_a_higher_one_starves(self):
        """On the state: batch is over target but chat has a replica with no place: batch holds (yield)."""
        auto = Autoscale(min=1, max=4, target=ScaleTarget(waiting_per_replica=2), cooldown=0)
        profiles = {"one": Profile(engine="sim")}
        models = {
            "batch": Model("/b", "one", 1, autoscale=auto, priority=0),
            "chat": Model("/c", "one", 1, autoscale=auto, priority=10),
        }
        state = ClusterState()
        state.apply_catalog(Catalog(profiles, models), "", 0)
        record = state.place(Replica("batch-0", "batch", 0, ()), None, 0, "placed")
        state.mark_ready(record, 1)
        state.autoscale.record_loads([ShardLoad("batch-0", record.attempt, waiting=6)], 10)
        state.note_unplaced((Unplaced("chat", 0, "needs 1 node with 1 free GPU"),), 10)
        step(state, 10)
        assert state.autoscale.models["batch"].last.cause == ScaleCause.YIELD
        assert state.scaled_catalog().models["batch"].replicas == 1
