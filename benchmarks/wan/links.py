"""Links, scenarios and the line-rate bound of the WAN benchmark: pure logic, no root needed.

A run is a star: the server and each site sit behind their own link (uplink and
downlink rate, one-way delay, random loss, up or down) into one router, the shaper
(`shaper.c`). Every packet crosses the sender's link, then the receiver's, so a
site's round trip to the server is twice the two links' delays.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

__all__ = [
    "MODEL_PARAMS",
    "SCENARIOS",
    "Cut",
    "Link",
    "Node",
    "Scenario",
    "line_rate_bound",
    "nodes_for",
    "render_links",
    "scenario_names",
    "select",
]

MODEL_PARAMS = 10_000_000
"""The issue's model: 10M float32 parameters, 40 MB."""

NUM_SITES = 3
SUBNET = "10.78.0"
SERVER = "server"


@dataclass(frozen=True)
class Link:
    """One node's access link. Rates in Mbit/s (0: unlimited), delay one way."""

    up_mbit: float = 0.0
    down_mbit: float = 0.0
    delay_ms: float = 0.0
    loss_pct: float = 0.0
    up: bool = True

    def __post_init__(self) -> None:
        for key in ("up_mbit", "down_mbit", "delay_ms"):
            if getattr(self, key) < 0 or not math.isfinite(getattr(self, key)):
                raise ValueError(
                    f"link {key} must be a finite number >= 0, got {getattr(self, key)}"
                )
        if not 0.0 <= self.loss_pct < 100.0:
            raise ValueError(f"link loss_pct must be in [0, 100), got {self.loss_pct}")

    @staticmethod
    def symmetric(mbit: float, delay_ms: float = 0.0, loss_pct: float = 0.0) -> Link:
        return Link(mbit, mbit, delay_ms, loss_pct)


@dataclass(frozen=True)
class Node:
    """A namespace on the emulated WAN: its name, namespace, TUN device and address."""

    name: str
    netns: str
    address: str
    tun: str = "wan0"


def nodes_for(prefix: str, num_sites: int = NUM_SITES) -> list[Node]:
    """The server (``.1``) and ``num_sites`` sites (``.11``, ``.12``, ...) in namespaces
    named ``{prefix}srv``, ``{prefix}s0``, ...; the prefix keeps runs apart."""
    if not prefix.isalnum() or len(prefix) > 8:
        raise ValueError(f"namespace prefix must be 1-8 letters/digits, got {prefix!r}")
    if not 1 <= num_sites <= 15:
        raise ValueError(
            f"num_sites must be in 1..15 (the shaper routes 16 nodes), got {num_sites}"
        )
    nodes = [Node(SERVER, f"{prefix}srv", f"{SUBNET}.1")]
    nodes += [Node(f"site-{i}", f"{prefix}s{i}", f"{SUBNET}.{11 + i}") for i in range(num_sites)]
    return nodes


def render_links(nodes: Sequence[Node], links: Mapping[str, Link]) -> str:
    """The shaper's config file: one line per node (see the header of ``shaper.c``)."""
    lines = ["# NAME NETNS TUN IPV4 UP_KBIT DOWN_KBIT DELAY_MS LOSS_PCT UP"]
    for node in nodes:
        if node.name not in links:
            raise ValueError(f"no link given for node {node.name!r}")
        link = links[node.name]
        lines.append(
            f"{node.name} {node.netns} {node.tun} {node.address} "
            f"{link.up_mbit * 1000:g} {link.down_mbit * 1000:g} {link.delay_ms:g} "
            f"{link.loss_pct:g} {int(link.up)}"
        )
    return "\n".join(lines) + "\n"


def _seconds(num_bytes: float, mbit: float) -> float:
    return 0.0 if mbit <= 0 else num_bytes * 8 / (mbit * 1e6)


def line_rate_bound(links: Mapping[str, Link], download_bytes: float, upload_bytes: float) -> float:
    """Seconds a round takes at best: every site downloads, then uploads, at line rate.

    Each direction is bound by the slowest site's link and by the server's link carrying
    all sites' bytes at once; delay, handshakes and compute are left out, so no run can
    beat it. 40 MB over 100 Mbit/s each way: 3.2 s + 3.2 s = 6.4 s.
    """
    sites = [link for name, link in links.items() if name != SERVER]
    if not sites:
        raise ValueError("line_rate_bound needs at least one site link")
    server = links.get(SERVER, Link())
    down = max(
        max(_seconds(download_bytes, s.down_mbit) for s in sites),
        _seconds(download_bytes * len(sites), server.up_mbit),
    )
    up = max(
        max(_seconds(upload_bytes, s.up_mbit) for s in sites),
        _seconds(upload_bytes * len(sites), server.down_mbit),
    )
    return down + up


@dataclass(frozen=True)
class Cut:
    """Take ``node``'s link down for ``seconds`` once ``watch`` has ``direction`` bytes.

    The byte count is the shaper's own (IP bytes the node sent or received since the
    system's run started), so the cut lands at the same point of the transfer for
    fedtrain and Flower: 1.5 models sent by a site is the middle of its second upload.
    """

    node: str
    seconds: float
    watch: str
    direction: Literal["sent", "received"]
    at_bytes: int

    def __post_init__(self) -> None:
        if self.seconds <= 0 or self.at_bytes < 0:
            raise ValueError(f"a cut needs seconds > 0 and at_bytes >= 0, got {self}")
        if self.direction not in ("sent", "received"):
            raise ValueError(f"cut direction must be 'sent' or 'received', got {self.direction!r}")


@dataclass(frozen=True)
class Scenario:
    """One row of the issue's table: links, what each system is told, what to do mid-run."""

    name: str
    title: str
    links: Mapping[str, Link]
    rounds: int = 3
    deadline_s: float = 300.0
    cc: str = "cubic"
    fedtrain_options: Mapping[str, Any] = field(default_factory=dict)
    round_timeout_s: float | None = None  # both systems; None: the deadline
    upload_fraction: float = 1.0  # bytes a site uploads per round, as a share of the model
    flower: bool = True
    flower_note: str = ""
    cut: Cut | None = None

    def bound_s(self, num_params: int) -> float:
        model = num_params * 4
        return line_rate_bound(self.links, model, model * self.upload_fraction)


def _star(site: Link, slow: Link | None = None, num_sites: int = NUM_SITES) -> dict[str, Link]:
    """The server unshaped (a data centre), every site behind ``site`` (site-0: ``slow``)."""
    links = {SERVER: Link()}
    for i in range(num_sites):
        links[f"site-{i}"] = slow if (i == 0 and slow is not None) else site
    return links


def _scenarios(num_params: int = MODEL_PARAMS) -> list[Scenario]:
    model = num_params * 4
    wan = Link.symmetric(100, delay_ms=20)
    slow = _star(Link.symmetric(1000, delay_ms=20), slow=Link.symmetric(10, delay_ms=20))

    def site_cut(seconds: float, direction: Literal["sent", "received"]) -> Cut:
        return Cut("site-0", seconds, "site-0", direction, int(1.5 * model))

    mid_upload = "site-0's link cut {s:g} s in the middle of its round-2 upload"
    return [
        Scenario("baseline", "100 Mbit/s, 40 ms RTT, cubic", _star(wan), rounds=3),
        Scenario(
            "loss1",
            "100 Mbit/s, 40 ms RTT, 1% loss, cubic",
            _star(Link.symmetric(100, delay_ms=20, loss_pct=1)),
            rounds=1,
            deadline_s=420,
        ),
        Scenario(
            "loss5",
            "100 Mbit/s, 40 ms RTT, 5% loss, cubic",
            _star(Link.symmetric(100, delay_ms=20, loss_pct=5)),
            rounds=1,
            deadline_s=300,
        ),
        Scenario(
            "slow-site", "site-0 at 10 Mbit/s, others 1 Gbit/s", slow, rounds=2, deadline_s=400
        ),
        Scenario(
            "slow-site-timeout",
            "site-0 at 10 Mbit/s, others 1 Gbit/s, round_timeout_s = 45",
            slow,
            rounds=2,
            deadline_s=300,
            round_timeout_s=45,
        ),
        *(
            Scenario(
                f"cut-upload-{s}",
                mid_upload.format(s=s),
                _star(wan),
                rounds=3,
                deadline_s=300,
                cut=site_cut(s, "sent"),
            )
            for s in (10, 45, 60)
        ),
        Scenario(
            "cut-download-10",
            "site-0's link cut 10 s in the middle of its round-2 download",
            _star(wan),
            rounds=3,
            deadline_s=300,
            cut=site_cut(10, "received"),
        ),
        Scenario(
            "cut-server-30",
            "the server's link cut 30 s in the middle of round 2's uploads",
            _star(wan),
            rounds=3,
            deadline_s=300,
            cut=Cut(SERVER, 30, SERVER, "received", int(1.5 * model * NUM_SITES)),
        ),
        Scenario(
            "slow-site-topk",
            "site-0 at 10 Mbit/s, others 1 Gbit/s, top-k 1% uploads",
            slow,
            rounds=2,
            deadline_s=300,
            fedtrain_options={"compression": {"codec": "topk", "fraction": 0.01}},
            # top-k 1%: int32 index + float32 value per kept entry = 2% of the model
            upload_fraction=0.02,
            flower=False,
            flower_note="Flower's FedAvg has no update codec",
        ),
    ]


SCENARIOS: dict[str, Scenario] = {s.name: s for s in _scenarios()}


def scenario_names() -> list[str]:
    return list(SCENARIOS)


def select(
    names: Sequence[str],
    *,
    num_params: int = MODEL_PARAMS,
    rounds: int | None = None,
    deadline_s: float | None = None,
    cc: str | None = None,
) -> list[Scenario]:
    """The scenarios named (``all``: every one), with the command line's overrides."""
    if num_params < 1:
        raise ValueError(f"--params must be >= 1, got {num_params}")
    table = {s.name: s for s in _scenarios(num_params)}  # cut points scale with the model
    wanted = list(table) if list(names) == ["all"] else list(names)
    unknown = [n for n in wanted if n not in table]
    if unknown:
        raise ValueError(
            f"unknown scenario(s) {', '.join(unknown)}; choose from: all, {', '.join(SCENARIOS)}"
        )
    if rounds is not None and rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    if deadline_s is not None and deadline_s <= 0:
        raise ValueError(f"--deadline must be > 0, got {deadline_s}")
    out = []
    for name in wanted:
        s = table[name]
        out.append(
            replace(
                s,
                rounds=rounds or s.rounds,
                deadline_s=deadline_s or s.deadline_s,
                cc=cc or s.cc,
            )
        )
    return out
