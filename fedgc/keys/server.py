"""The server's keys (part ``server``): sampling, the server step, defences and aggregation, the
downlink, timeouts and evaluation, node authentication.

Kept by the server (never sent to clients). A key the server reads for its round goes here;
one a method adds for its own server half goes with the method (``sent=False`` in its
:attr:`fedgc.methods.Method.settings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedgc.schema import Check, SettingsError, setting

__all__ = ["AGGREGATIONS", "DOWNLINKS", "DOWNLINK_VALUES", "MODES", "ROBUST_MODES",
           "ROBUST_PROFILES", "STALENESS_WEIGHTS", "ServerKeys", "parse_client_nodes"]

#: What clients are sent: "auto" (a patch when smaller) or always the dense model.
DOWNLINKS = ("auto", "dense")
#: How a compressed broadcast moves the entries it sends (``downlink_values``): copied on the
#: float16 or int8 grid, or moved by sign * mean per tensor (STC's downlink, ``ternary``).
DOWNLINK_VALUES = ("float16", "int8", "ternary")
#: How the server combines a round's updates: the weighted mean (FedAvg), coordinate-wise
#: robust statistics (``server.aggregation``), centered clipping or FLTrust (``server.robust``).
AGGREGATIONS = ("mean", "trimmed_mean", "median", "centered_clip", "fltrust")
#: ``robust``: the defaults of the aggregation keys for clients that are not trusted (on: a
#: deployment's, the phone bridge's) or are (off: a simulation's, plain FedAvg); auto decides by
#: where the run runs (``server.app.run_server``).
ROBUST_MODES = ("auto", "on", "off")
#: ``gate_reference``: what the direction gate compares each update with (server.aggregation).
GATE_REFERENCES = ("history", "trend", "round")
#: ``mode``: a synchronous round, or the asynchronous buffered loop (server.async_loop).
MODES = ("sync", "async")
#: ``async.staleness``: the weight of a reply trained on a model ``s`` versions old.
STALENESS_WEIGHTS = ("polynomial", "constant")
#: What ``robust`` gives the aggregation keys left empty (docs/threat_model.md: why these).
ROBUST_PROFILES: dict[str, dict[str, Any]] = {
    "off": {"aggregation": "mean", "max_weight_ratio": 0.0, "max_norm_ratio": 0.0,
            "min_cosine": -1.0, "gate_memory": 0.0, "gate_memory_below": 0.0,
            "gate_first_bar": -1.0, "clip_radius_clean": 0.0},
    "on": {"aggregation": "centered_clip", "max_weight_ratio": 1.0, "max_norm_ratio": 0.0,
           "min_cosine": 0.0, "gate_memory": 0.95, "gate_memory_below": -0.2,
           "gate_first_bar": -0.2, "clip_radius_clean": 2.0},
}


@dataclass(frozen=True)
class ServerKeys:
    """What the server does with a round: who, how it combines and steps, what it sends."""

    PART = "server"

    mode: str = setting("sync", "mode", "sync: rounds, each waiting for its clients; async: "
                        "FedBuff's buffered asynchronous aggregation (async.*, docs/async.md): "
                        "async.concurrency clients train at once and the server applies an "
                        "update every async.buffer replies (an applied step is a round of the "
                        "results; rounds counts them)", Check(choices=MODES))
    async_concurrency: int = setting(10, "async.concurrency", "with mode = async: clients "
                                     "training at once (FedBuff's C); at most num_clients",
                                     Check(1, 1_000_000))
    async_buffer: int = setting(5, "async.buffer", "with mode = async: the server applies an "
                                "update every this many accepted replies (FedBuff's K); at most "
                                "async.concurrency", Check(1, 1_000_000))
    async_max_staleness: int = setting(20, "async.max_staleness", "with mode = async: a reply "
                                       "trained on a model more than this many applied steps "
                                       "old is refused and counted (reason: stale)",
                                       Check(0, 1_000_000))
    async_staleness: str = setting("polynomial", "async.staleness", "with mode = async: the "
                                   "weight of a reply s steps stale: polynomial = (1 + s) ** "
                                   "-async.staleness_exponent (FedBuff's 1/sqrt(1+s) at 0.5); "
                                   "constant = 1", Check(choices=STALENESS_WEIGHTS))
    async_staleness_exponent: float = setting(0.75, "async.staleness_exponent", "with "
                                              "async.staleness = polynomial: the exponent a "
                                              "(0.75: ended async dgc's dips, docs/async.md)",
                                              Check(0.0, 10.0))
    over_selection: float = setting(1.0, "over_selection", "sample ceil(clients_per_round * "
                                    "over_selection) clients, aggregate the first "
                                    "clients_per_round valid replies (straggler defence)",
                                    Check(1.0, 10.0))
    server_lr: float | None = setting(None, "server_lr", "server learning rate: global -= "
                                      "server_lr * momentum buffer; empty = the method's "
                                      "default", Check(0.0, low_open=True), fallback=1.0)
    server_momentum: float | None = setting(None, "server_momentum", "server momentum "
                                            "(FedAvgM convention: buf = m*buf + avg), DGC's "
                                            "momentum applied once per round to the aggregate, "
                                            "where it is never stale; empty = the method's "
                                            "default", Check(0.0, 1.0, high_open=True),
                                            fallback=0.0)
    robust: str = setting("auto", "robust", "the defaults of the aggregation keys left empty "
                          "(aggregation, max_weight_ratio, max_norm_ratio, min_cosine, "
                          "gate_memory, gate_memory_below, gate_first_bar, "
                          "clip_radius_clean): off = plain "
                          "FedAvg (mean, no cap, no clip, no gate); on = for clients that "
                          "are not trusted (centered_clip, weights capped at the round's "
                          "median, updates pointing clearly against the aggregates' moving "
                          "average left out: gate_first_bar -0.2, which opens a client's "
                          "record: gate_memory 0.95, gate_memory_below -0.2; a client with an "
                          "open record left out below min_cosine 0 and held while its record "
                          "is bad; a round the gate found clean clipped at radius 2: "
                          "clip_radius_clean); auto = "
                          "on in deployments and behind the phone bridge, off in simulation "
                          "(docs/threat_model.md)",
                          Check(choices=ROBUST_MODES))
    max_weight_ratio: float | None = setting(
        None, "max_weight_ratio", "a client's weight (num-examples) is capped at this times the "
        "median claim of the round's valid replies (server/defences.py); 0 = no cap; empty = "
        "by robust (off: 0, on: 1)", Check(0.0))
    max_norm_ratio: float | None = setting(
        None, "max_norm_ratio", "a client's update (with its signs) is scaled down to at most "
        "this times the median norm of the round's valid replies (1: norm bounding at the "
        "median, Sun et al. 2019); 0 = no clip; empty = by robust (0)", Check(0.0))
    aggregation: str | None = setting(
        None, "aggregation", "mean: weighted by num-examples (FedAvg); trimmed_mean or median: "
        "coordinate-wise over the round's clients, unweighted (Yin et al. 2018); centered_clip: "
        "each update's pull on last round's aggregate clipped to clip_radius times the median "
        "distance (Karimireddy et al. 2021); fltrust: updates scaled to the server's own update "
        "on root_samples training examples and weighted by their cosine with it (Cao et al. "
        "2021); empty = by robust (off: mean, on: centered_clip)",
        Check(choices=AGGREGATIONS))
    trim_fraction: float = setting(0.1, "trim_fraction", "with aggregation = trimmed_mean: the "
                                   "fraction of clients cut at each end of every coordinate "
                                   "(at least one client when above 0)",
                                   Check(0.0, 0.5, high_open=True))
    clip_radius: float = setting(1.0, "clip_radius", "with aggregation = centered_clip: the "
                                 "clipping radius, in medians of the clients' distances to the "
                                 "center", Check(0.0, low_open=True))
    clip_iterations: int = setting(3, "clip_iterations", "with aggregation = centered_clip: "
                                   "clipping iterations per round", Check(1, 100))
    clip_radius_clean: float | None = setting(
        None, "clip_radius_clean", "with aggregation = centered_clip and min_cosine above -1: "
        "the clipping radius (in medians of the distances) of a round whose direction gate "
        "judged it and left nobody out, none of its clients with an open gate_memory record "
        "(not round 1); 0 = clip_radius in every round; empty = by robust (off: 0, on: 2)",
        Check(0.0))
    bucket_size: int = setting(1, "bucket_size", "with aggregation = centered_clip: the "
                               "clients, in a seeded random order each round, averaged in "
                               "buckets of this many before clipping (Karimireddy et al. "
                               "2022's bucketing); 1 = none", Check(1, 100))
    min_cosine: float | None = setting(
        None, "min_cosine", "a client's update is left out of the round (rejected, its "
        "method folds it back) when its cosine with the direction of history (gate_reference; "
        "none in round 1) is below this (server/aggregation.py); -1 = none left "
        "out; empty = by robust (off: -1, on: 0)", Check(-1.0, 1.0))
    gate_reference: str = setting(
        "trend", "gate_reference", "with min_cosine above -1: what an update's cosine is "
        "taken with: history = the last round's aggregate (which one hostile update let in "
        "can turn against the honest clients); trend = the moving average of "
        "the aggregates (0.9 of the last trend, 0.1 of the new aggregate, from round 1's); "
        "round = this round's own centered "
        "clipping of every update from there (the majority's direction now, which a hostile "
        "minority let in once cannot turn against the honest clients)",
        Check(choices=GATE_REFERENCES))
    gate_memory: float | None = setting(
        None, "gate_memory", "with min_cosine above -1: the gate remembers a repeat offender: "
        "each client's record counts the rounds the gate left it out, each count decayed by "
        "this per round the client takes part in, and a client whose record reached 1.5 "
        "(left out twice, recently) is left out while it stays there, whatever its cosine; "
        "kept by client key (in a deployment a node's: a client that comes back under a new "
        "identity starts with a clean record); 0 = no record; empty = by robust (off: 0, on: "
        "0.95)",
        Check(0.0, 1.0, high_open=True))
    gate_first_bar: float | None = setting(
        None, "gate_first_bar", "with gate_memory above 0: the direction gate's bar for a "
        "client without an open record (it is left out only below this; one whose record is "
        "open, below min_cosine): an honest outlier near min_cosine stays in, a sign flipper "
        "whose first updates opened its record is judged at min_cosine; empty = by robust "
        "(off: -1, unread without gate_memory; on: -0.2)",
        Check(-1.0, 1.0))
    gate_memory_below: float | None = setting(
        None, "gate_memory_below", "with gate_memory above 0: only a clear offence opens a "
        "client's record: a left-out starts one only when its cosine is below this too, and "
        "once open every left-out counts (a sign flipper's first updates point clearly against "
        "the reference; an honest outlier left out near the bar never opens one); at or above "
        "min_cosine every left-out counts; empty = by robust (off: 0, on: -0.2)",
        Check(-1.0, 1.0))
    root_samples: int = setting(100, "root_samples", "with aggregation = fltrust: training "
                                "examples the server holds (a seeded sample of the task's "
                                "training split), on which it takes its own round each round",
                                Check(1))
    downlink: str = setting("auto", "downlink", "auto: send a patch instead of the dense model "
                            "when the client holds a recent version and the patch is smaller",
                            Check(choices=DOWNLINKS))
    downlink_history: int = setting(1000, "downlink_history", "the most versions a patch may "
                                    "span; a client holding an older version gets the dense "
                                    "model (memory: one int32 per parameter, whatever the "
                                    "value)", Check(0))
    downlink_density: float | None = setting(
        None, "downlink_density", "1: clients are sent the global model exactly; below 1: a "
        "compressed broadcast, each round the server moves this fraction of the matrix entries "
        "of the model clients hold, those that differ most from the global model, by "
        "downlink_values (error feedback on the server; 1-D tensors whole, except with "
        "ternary); dense and fedavgm runs always get the exact model; empty = the method's "
        "default", Check(0.0, 1.0, low_open=True), fallback=0.05)
    downlink_values: str | None = setting(
        None, "downlink_values", "with downlink_density < 1: the grid the broadcast's matrix "
        "entries are rounded to; float16 (2 bytes per patch value) or int8 (a byte or less: per "
        "tensor a power-of-two step whose range is 8x its largest initial entry, doubled when "
        "the model outgrows it); or ternary: per tensor (1-D too) the entries move by sign * "
        "their mean difference, a bit each in a one-round patch (STC's downlink); empty = the "
        "method's default", Check(choices=DOWNLINK_VALUES), fallback="int8")
    downlink_deltas: bool = setting(True, "downlink_deltas", "with downlink_values int8: version "
                                    "0 is broadcast on the grid too, and a patch on the one "
                                    "version a client is known to hold carries differences "
                                    "(which the client adds) where those encode smaller")
    downlink_deadband: float | None = setting(
        None, "downlink_deadband", "with downlink_values int8: an entry of the broadcast moves "
        "only when the global model is more than this many grid steps from it (hysteresis: "
        "fewer entries change per round); 0.5 = whenever it rounds to another grid point; "
        "empty = the method's default", Check(0.5, 127.0), fallback=0.5)
    downlink_vectors: str | None = setting(
        None, "downlink_vectors", "with downlink_density < 1: the broadcast's one-dimensional "
        "tensors (biases) are copied whole every round, exactly (float32) or rounded to "
        "float16 (the rounding stays in the difference, and an entry whose float16 value did "
        "not move is not sent); empty = the method's default",
        Check(choices=("float32", "float16")), fallback="float32")
    downlink_context: bool | None = setting(
        None, "downlink_context", "with downlink_values int8 and downlink_deltas: a patch on "
        "the one version a client holds sends a matrix's changed entries per segment of its "
        "entries ranked by how far that version has moved from version 0 (which clients "
        "build), where that encodes smaller, and differences without a code for zero (wire "
        "value dtype 66); the same model in about a fifth fewer patch bytes (phones join "
        "them too: docs/android.md); empty = the method's default", fallback=False)
    downlink_compact: bool | None = setting(
        None, "downlink_compact", "patches as compact messages (tensors by their place in the "
        "model and its ranked segments, sizes as varints: dgc.wire.compact, docs/wire.md); the "
        "same sections in fewer bytes (phones read them too: docs/android.md); empty = the "
        "method's default",
        fallback=False)
    downlink_lookahead: float = setting(1.0, "downlink_lookahead", "with downlink_density < 1 "
                                        "and server momentum: the broadcast follows the global "
                                        "model minus this fraction of the step the momentum "
                                        "buffer already fixes (Nesterov's look-ahead), so that "
                                        "clients lag it less; 0 = follow the global model",
                                        Check(0.0, 1.0))
    clients_build_initial_model: bool = setting(
        True, "clients_build_initial_model", "clients build version 0 of the model from the "
        "run's seed as the server does (the app ships the initial model), so a first contact "
        "gets a patch on version 0 instead of the dense model")
    round_timeout_s: float = setting(600.0, "round_timeout_s", "seconds to wait for train "
                                     "replies; a later reply counts as failed (round 1 includes "
                                     "Ray start-up)", Check(0.0, low_open=True))
    eval_samples: int = setting(0, "eval_samples", "evaluate the global model every round on "
                                "a seeded random subset of this many test samples (the same "
                                "subset every round); 0 = the whole test split (Shakespeare's "
                                "10,000 cost ~0.5 ms each in the LSTM)", Check(0))
    fraction_evaluate: float = setting(0.0, "fraction_evaluate", "fraction of clients for "
                                       "federated evaluation (centralized evaluation runs every "
                                       "round regardless)", Check(0.0, 1.0))
    client_nodes: str = setting("", "client_nodes", "with SuperNode authentication "
                                "(flower-superlink --enable-supernode-auth): the authenticated "
                                "node that serves each client key, 'key:node_id,...' (the node "
                                "id `flwr supernode register` prints); a node not listed, or "
                                "claiming another key, is never sampled; empty: a node is the "
                                "client key it claims (docs/threat_model.md)")

    def check_server_keys(self) -> None:
        """The rules between these keys."""
        parse_client_nodes(self.client_nodes)
        if self.mode == "async" and self.async_buffer > self.async_concurrency:
            raise SettingsError(f"async.buffer = {self.async_buffer} exceeds async.concurrency = "
                                f"{self.async_concurrency}: the buffer would wait for more "
                                f"replies than clients train at once")

    def robust_defaults(self) -> dict[str, Any]:
        """The aggregation keys left empty, with the values ``robust``'s profile gives them
        (:data:`ROBUST_PROFILES`; auto: off until the run knows where it runs)."""
        profile = ROBUST_PROFILES["on" if self.robust == "on" else "off"]
        return {k: v for k, v in profile.items() if getattr(self, k) is None}


def parse_client_nodes(text: str) -> dict[int, int]:
    """``"0:8421,1:977"`` -> ``{0: 8421, 1: 977}`` (client key -> authenticated node id).

    Raises
    ------
    SettingsError
        An item that is not ``key:node_id`` of whole numbers (keys >= 0, node ids >= 1), or a
        key or node id listed twice.
    """
    out: dict[int, int] = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        key, sep, node = item.partition(":")
        if not (sep and key.strip().isascii() and key.strip().isdigit()
                and node.strip().isascii() and node.strip().isdigit()
                and len(node.strip()) <= 20 and int(node) >= 1):
            raise SettingsError(f"client_nodes item {item[:60]!r} is not 'key:node_id' (whole "
                                f"numbers, node ids as `flwr supernode register` prints them)")
        if int(key) in out or int(node) in out.values():
            raise SettingsError(f"client_nodes lists client key {int(key)} or node {int(node)} "
                                f"twice; a node serves one client and a client one node")
        out[int(key)] = int(node)
    return out
