"""``llmgw ctl replicas`` and ``ctl describe replica ID``: replicas, their shards, and what each shard runs.

``-o wide`` and ``describe`` show per shard what its agent reported: the
command line, the environment llmgw set for it, its node, its log file and
the engine version the node found; no need to run ``ps`` on the node.
"""

from __future__ import annotations

import shlex

import click

from llmgw.ctl.client import AdminClient, CtlError
from llmgw.ctl.options import output_option, watch_options
from llmgw.ctl.output import show, show_admin, table
from llmgw.scheduler import format_bytes
from llmgw.wire import ReplicaList, ReplicaStatus, ShardStatus, to_json

__all__ = ["replicas", "describe", "command_line", "describe_lines", "replica_lines", "staging_line"]


def command_line(shard: ShardStatus) -> str:
    """The shard's command as a shell line: the variables llmgw set, then the argv; ``-`` until reported."""
    if not shard.argv:
        return "-"
    assignments = [f"{name}={shlex.quote(value)}" for name, value in sorted(shard.env.items())]
    return " ".join([*assignments, shlex.join(shard.argv)])


def replica_lines(data: ReplicaList, wide: bool) -> list[str]:
    """What ``ctl replicas`` prints: a row per replica (``wide``: per shard, with pid, engine, log and
    command), then the replicas that cannot be placed and the rollouts not done."""
    if wide:
        rows = [
            [r.id, r.model, _state(r), f"r{s.rank}", s.node, s.port, s.state, s.pid or "-"]
            + [s.engine_version or "-", s.log_path or "-", command_line(s)]
            for r in data.replicas
            for s in r.shards
        ]
        headers = ["replica", "model", "state", "rank", "node", "port", "shard", "pid", "engine", "log"]
        lines = [table(rows, [*headers, "command"])]
    else:
        rows = []
        for r in data.replicas:
            shards = "; ".join(
                f"r{s.rank} {s.node}:{s.port} {s.state}" + (f" pid {s.pid}" if s.pid else "")
                + (f" ({s.detail})" if s.state == "staging" and s.detail and not _summed(r) else "")
                for s in r.shards
            )
            note = r.reason or (f"replaces {r.replaces}" if r.replaces else "")
            if r.staging is not None:
                note = "; ".join(filter(None, [staging_line(r), note]))
            rows.append([r.id, r.model, _state(r), r.failures, shards, note])
        lines = [table(rows, ["replica", "model", "state", "failures", "shards", "note"])]
    lines += [f"unplaced: {u.id}: {u.reason}" for u in data.unplaced]
    for rollout in data.rollouts:
        if rollout.state != "done":
            why = f": {rollout.reason}" if rollout.reason else ""
            progress = f"{rollout.updated}/{rollout.replicas} updated, {rollout.outdated} outdated"
            lines.append(f"rollout {rollout.model}: {rollout.state} ({progress}){why}")
    return lines


@click.command()
@output_option()
@click.option("--wide", is_flag=True, hidden=True, help="Deprecated: -o wide.")
@watch_options()
@click.pass_context
def replicas(ctx: click.Context, output: str, wide: bool, watch: bool, interval: float) -> None:
    """List replicas with their shards, and those that cannot be placed, with why.

    -o wide: one row per shard, with its pid, engine version, log and command.
    """
    output = "wide" if wide and output == "table" else output
    show_admin(ctx, "/v1/admin/replicas", ReplicaList, replica_lines, output, watch=watch, interval=interval)


def staging_line(replica: ReplicaStatus) -> str:
    """``fetching 40% (1.9 of 4.8 GB, 35 MB/s, ETA 1 min 23 s)`` for a staging replica; empty otherwise."""
    progress = replica.staging
    if progress is None:
        return ""
    amounts = f"{format_bytes(progress.bytes_present)} of {format_bytes(progress.bytes_total)}"
    rate = f", {format_bytes(int(progress.rate))}/s" if progress.rate > 0 else ""
    eta = f", ETA {_duration(replica.eta)}" if replica.eta is not None else ""
    return f"fetching {progress.percent}% ({amounts}{rate}{eta})"


def _summed(replica: ReplicaStatus) -> bool:
    """Whether the note column says all there is of a staging replica's one shard (its progress)."""
    return replica.staging is not None and len(replica.shards) == 1


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def _state(replica: ReplicaStatus) -> str:
    """The replica's state, and ``outdated`` when it runs another command than the catalog asks."""
    return f"{replica.state} (outdated)" if replica.outdated else replica.state


def describe_lines(replica: ReplicaStatus) -> list[str]:
    """What ``ctl describe replica`` prints: the replica, then each shard with what its agent reported."""
    lines = [
        f"replica   {replica.id}",
        f"model     {replica.model}",
        f"state     {_state(replica)} (attempt {replica.attempt}, {replica.failures} failures)",
        f"fabric    {replica.fabric or '-'}",
    ]
    if replica.replaces:
        lines.append(f"replaces  {replica.replaces}")
    if replica.reason:
        lines.append(f"reason    {replica.reason}")
    if replica.staging is not None:
        lines.append(f"staging   {staging_line(replica)}")
    for s in replica.shards:
        gpus = ",".join(map(str, s.gpus)) or "-"
        pid = f", pid {s.pid}" if s.pid else ""
        lines.append(f"shard r{s.rank} on {s.node}, port {s.port}, GPUs {gpus}: {s.state}{pid}")
        if s.detail:
            lines.append(f"  detail   {s.detail}")
        lines.append(f"  engine   {s.engine_version or '-'}")
        lines.append(f"  log      {s.log_path or '-'}")
        env = [f"{name}={value}" for name, value in sorted(s.env.items())] or ["-"]
        lines.append(f"  env      {env[0]}")
        lines.extend(f"           {line}" for line in env[1:])
        lines.append(f"  argv     {shlex.join(s.argv) if s.argv else '- (not built yet)'}")
    return lines


@click.group()
def describe() -> None:
    """Show one thing in detail."""


@describe.command("replica")
@click.argument("replica_id", metavar="ID")
@output_option()
@click.pass_context
def describe_replica(ctx: click.Context, replica_id: str, output: str) -> None:
    """Show replica ID: its state, and per shard the node, the command line, the environment llmgw set,
    the log file and the engine version the node reported."""
    data = AdminClient.for_command(ctx).request("GET", "/v1/admin/replicas", ReplicaList)
    found = next((r for r in data.replicas if r.id == replica_id), None)
    if found is None:
        unplaced = next((u for u in data.unplaced if u.id == replica_id), None)
        if unplaced is not None:
            raise CtlError(f"replica {replica_id} is not placed: {unplaced.reason}")
        known = ", ".join(r.id for r in data.replicas) or "none"
        raise CtlError(f"no replica {replica_id!r} (replicas: {known})")
    show(output, lambda: found, to_json, lambda replica, _wide: describe_lines(replica))
