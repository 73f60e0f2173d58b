"""``cgx-ps status``: how every shard is doing, one line each, read from the shards themselves.

    cgx-ps status                  shards from CGX_PS_SERVERS; token and TLS from the env, as workers
    cgx-ps status --watch [5]      refresh every 5 s until Ctrl-C
    cgx-ps status --json           one JSON object per refresh, for scripts

Per shard: health (SERVING, NOT_SERVING, or DOWN with the reason) from the open gRPC health
service; from the Status RPC, which needs the job token (CGX_PS_TOKEN_FILE): the raw data plane's
port (DATA; "off" when the shard has none, and its workers stream over gRPC), the session and its
job, members (nodes x local ranks), the quorum (K/N, the grace, late pushes per node; "-" when
rounds wait for every node), rounds completed, bytes in/out per second, in-flight bytes
against the cap, and the shard's last logged error. Rates are counter differences over the
shard's own clock between two samples: consecutive refreshes with --watch, otherwise two samples
--sample seconds apart.

Exit status: 0 when every shard is SERVING and answered Status consistently with its place in
the list; 1 otherwise (a shard down or draining, a wrong token, shards listed out of order),
so it can gate readiness; 2 for a bad configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import grpc

from ..net.security import ChannelSecurity, CredentialError
from ..v1 import ps_pb2, ps_pb2_grpc
from .wait_for_shards import check_health, resolve

__all__ = ["ShardReport", "probe", "probe_all", "render_table", "run_status", "to_json"]

_WHY = {
    grpc.StatusCode.UNAUTHENTICATED: "set CGX_PS_TOKEN_FILE to the job's token file",
    # a shard's own --health-port says so itself (and names the gRPC port): this is gRPC's bare answer
    grpc.StatusCode.UNIMPLEMENTED: "not a shard's gRPC port (another gRPC server, or an older shard's "
                                   "--health-port), or a cgx-ps without the Status RPC",
}
_GRPC_NOT_FOUND = "Method not found!"  # grpc's details for a method no handler serves


@dataclass
class ShardReport:
    index: int  # place in the list: the shard index workers assume
    address: str
    health: str  # SERVING, NOT_SERVING, ... or DOWN
    health_detail: str = ""  # why DOWN
    status: ps_pb2.StatusResponse | None = None
    problems: list[str] = field(default_factory=list)  # what stops this shard from being OK
    # per second over the shard's clock since the previous sample of the same instance
    rates: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.health == "SERVING" and not self.problems


def probe(index: int, address: str, security: ChannelSecurity, num_shards: int, timeout: float = 3.0) -> ShardReport:
    """One sample of one shard: health, then Status."""
    report = ShardReport(index, address, "DOWN")
    try:
        with security.sync_channel(address) as channel:
            health, error = check_health(channel, timeout)
            if error:  # no answer at all: the gRPC code and its details say why
                report.health_detail = f"{health}: {error}"
                return report
            report.health = health
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            report.status = stub.Status(ps_pb2.StatusRequest(), metadata=security.metadata(), timeout=timeout)
    except CredentialError as exc:
        report.health_detail = str(exc)
        return report
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        hint = _WHY.get(code) if code is not grpc.StatusCode.UNIMPLEMENTED or exc.details() == _GRPC_NOT_FOUND else None
        report.problems.append(f"Status refused: {code.name}: {exc.details()}" + (f" ({hint})" if hint else ""))
        return report
    s = report.status
    if s.shard_index != index or s.num_shards != num_shards:
        report.problems.append(f"listed as shard {index} of {num_shards}, but it is shard {s.shard_index} of "
                               f"{s.num_shards}: CGX_PS_SERVERS must list the shards in index order")
    if s.draining:
        report.problems.append("draining: the shard is shutting down")
    return report


def probe_all(addresses: Sequence[str], security: ChannelSecurity, timeout: float = 3.0,
              previous: Sequence[ShardReport] = ()) -> list[ShardReport]:
    """A sample of every shard at once (threads: one slow shard does not delay the others),
    with rates against ``previous`` where it is the same shard instance."""
    with ThreadPoolExecutor(max_workers=min(16, len(addresses))) as pool:
        reports = list(pool.map(lambda ia: probe(ia[0], ia[1], security, len(addresses), timeout),
                                enumerate(addresses)))
    for report, before in zip(reports, previous):
        _add_rates(report, before)
    return reports


def _add_rates(report: ShardReport, before: ShardReport) -> None:
    now, then = report.status, before.status
    if now is None or then is None or now.instance_id != then.instance_id:
        return  # unknown, or the shard restarted: its counters started over
    dt = now.uptime_s - then.uptime_s
    if dt <= 0:
        return
    for name in ("bytes_in", "bytes_out", "rounds_total", "rounds_completed"):
        delta = getattr(now, name) - getattr(then, name)
        if delta >= 0:  # rounds_completed starts over with a new session
            report.rates[name] = delta / dt


# ---- output ---------------------------------------------------------------------------------------


def _bytes(n: float) -> str:
    """Binary units, as --max-inflight-mb counts them (1024 MB there is "1.0 GiB" here)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""  # unreachable


def _row(r: ShardReport) -> list[str]:
    s = r.status
    if s is None:
        return [str(r.index), r.address, r.health] + ["-"] * 9 + ["; ".join(r.problems) or r.health_detail]
    state = ps_pb2.SessionState.Name(s.session_state).removeprefix("SESSION_STATE_").lower()
    members = "-"
    if s.nodes_registered:
        per, rest = divmod(s.members_registered, s.nodes_registered)
        members = f"{s.nodes_registered}/{s.num_nodes} x {per}" if not rest else \
            f"{s.nodes_registered}/{s.num_nodes} ({s.members_registered})"
    rounds = str(s.rounds_completed)
    if "rounds_completed" in r.rates:
        rounds += f" ({r.rates['rounds_completed']:.1f}/s)"
    error = "; ".join(r.problems)
    if s.last_error:
        error = (error + "; " if error else "") + f"{s.last_error} ({s.last_error_age_s:.0f}s ago)"
    return [str(r.index), r.address, "DRAINING" if s.draining else r.health, str(s.data_port or "off"),
            state + (f" {s.job_id}" if s.job_id else ""), members, _quorum(s), rounds,
            _bytes(r.rates["bytes_in"]) + "/s" if "bytes_in" in r.rates else "-",
            _bytes(r.rates["bytes_out"]) + "/s" if "bytes_out" in r.rates else "-",
            f"{_bytes(s.inflight_bytes)}/{_bytes(s.max_inflight_bytes)}", str(s.rounds_failed), error or "-"]


def _quorum(s: ps_pb2.StatusResponse) -> str:
    """QUORUM: "-" (rounds wait for every node), else K/N, the grace and the late pushes per node."""
    if not s.quorum:
        return "-"
    late = " ".join(f"{node}:{count}" for node, count in zip(s.late_nodes, s.late_pushes))
    return f"{s.quorum}/{s.num_nodes} +{s.grace_ms}ms" + (f" late {late}" if late else "")


_HEADER = ["SHARD", "ADDRESS", "HEALTH", "DATA", "SESSION JOB", "NODES x RANKS", "QUORUM", "ROUNDS", "IN", "OUT",
           "IN-FLIGHT/CAP", "FAILED", "LAST ERROR"]


def render_table(reports: Sequence[ShardReport], width: int = 200) -> str:
    rows = [_HEADER] + [_row(r) for r in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_HEADER) - 1)]
    lines = []
    for row in rows:
        line = "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1]
        lines.append(line if len(line) <= width else line[:width - 1] + "…")
    return "\n".join(lines)


def to_json(reports: Sequence[ShardReport]) -> dict:
    shards = []
    for r in reports:
        status = None
        if r.status is not None:
            status = {f.name: getattr(r.status, f.name) for f in r.status.DESCRIPTOR.fields}
            status.update({k: list(v) for k, v in status.items() if not isinstance(v, (int, float, str, bool))})
            status["session_state"] = ps_pb2.SessionState.Name(r.status.session_state)
        shards.append({"shard": r.index, "address": r.address, "health": r.health, "health_detail": r.health_detail,
                       "ok": r.ok, "problems": r.problems, "status": status,
                       "rates": {f"{k}_per_s": v for k, v in r.rates.items()}})
    return {"time": time.time(), "ok": all(r.ok for r in reports), "shards": shards}


# ---- the command ----------------------------------------------------------------------------------


def run_status(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> int:
    """``cgx-ps status``: one line per shard (health, session, rounds, bytes/s, last error), once
    or every ``--watch`` seconds until Ctrl-C.

    Args:
        args: the parsed flags of ``cgx-ps status`` (the shard list, ``--watch``, ``--json``, ...).
        env: where the shard list, job token and TLS settings are read (default: ``os.environ``).

    Returns:
        The exit status: 0 when every shard is SERVING and answers, 1 otherwise, 2 for a bad
        shard list or credential setting (said on stderr).
    """
    resolved = resolve("cgx-ps status", args, env)
    if resolved is None:
        return 2
    addresses, security = resolved
    reports: list[ShardReport] = []
    try:
        if args.watch is None and args.sample > 0:
            reports = probe_all(addresses, security, args.timeout)
            time.sleep(args.sample)
        while True:
            t0 = time.monotonic()
            reports = probe_all(addresses, security, args.timeout, previous=reports)
            _show(reports, args)
            if args.watch is None:
                break
            time.sleep(max(0.0, args.watch - (time.monotonic() - t0)))
    except KeyboardInterrupt:
        pass
    return 0 if reports and all(r.ok for r in reports) else 1


def _show(reports: Sequence[ShardReport], args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps(to_json(reports)), flush=True)
        return
    tty = sys.stdout.isatty()
    if args.watch is not None and tty:
        print("\033[H\033[2J", end="")  # clear the screen: a refreshing table, like top
    width = os.get_terminal_size().columns if tty else 10_000
    ok = sum(r.ok for r in reports)
    print(f"{time.strftime('%H:%M:%S')}  {ok}/{len(reports)} shards OK", flush=True)
    print(render_table(reports, width), flush=True)
