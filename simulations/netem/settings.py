"""NetemSettings: the ``netem.*`` run-config keys of the emulator, on the one settings engine.

The keys are declared like every other run key (:func:`fedgc.settings.setting`), so that
``python -m simulations keys`` lists them (part ``netem``) and a bad value is the same
:class:`fedgc.settings.SettingsError` naming the key and its accepted range. The strategy puts
these keys in every train message's config, so the Flower mod on the client side rebuilds
exactly the server's scenario; ``--set netem.mix=lte:0.5,3g:0.5`` style strings are accepted for
every key.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, get_type_hints

from fedgc.schema import to_flat
from fedgc.settings import (
    Check,
    SettingsError,
    coerce,
    fields_of,
    parse,
    setting,
    unknown_keys,
    validate,
)
from simulations.netem.energy import (
    POWER_MODELS,
    PowerModelError,
    RadioPowerModel,
    load_power_models,
)
from simulations.netem.errors import NetemError
from simulations.netem.link import OUTAGE_POLICIES
from simulations.netem.presets import DEVICE_PRESETS, LINK_PRESETS, LinkProfile
from simulations.netem.protocol import ProtocolError, ProtocolModel, load_protocols
from simulations.netem.scenario import Assignment, assign
from simulations.netem.staleness import STALE_POLICIES, StalePolicy
from simulations.netem.throughput import Trace, load_trace

PREFIX = "netem."
#: Per-round keys the strategy adds next to the settings (not settings themselves).
ROUND_KEY = "netem.round"
ROUND_START_KEY = "netem.round_start_s"
#: The link preset ``netem.mix`` may name when ``netem.trace_down`` and ``netem.trace_up`` are
#: set: a link that replays those trace files.
TRACE_PRESET = "trace"
#: The profile charged when the emulator is on and ``netem.protocol`` is not given: a phone
#: through fedgc's bridge (docs/netem.md, "A round's time from its causes").
DEFAULT_PROTOCOL = "bridge-tls"
#: ``netem.protocol``'s value for the payload alone: no protocol bytes, no orchestration.
NO_PROTOCOL = "none"
#: Keys that override a part of the profile (``netem.x`` -> the profile's field).
PROFILE_KEYS = {"poll_interval_s": "poll_interval_s", "app_startup_s": "clientapp_startup_s",
                "server_measured": "server_measured", "server_s": "server_s"}


def _fraction() -> Check:
    return Check(0.0, 1.0)


def _positive() -> Check:
    return Check(0.0, low_open=True)


@dataclass(frozen=True)
class NetemSettings:
    """Every emulator setting of a run; the key of field ``x`` is ``netem.x``.

    Each field is documented in its ``setting(...)`` declaration (``python -m simulations keys``
    prints them); ``mix`` and ``device_mix`` must also name known presets by fractions that sum
    to 1. Values given as strings (``--set``) are converted as for every run key.
    """

    enabled: bool = setting(False, "netem.enabled", "emulate the network (virtual time, "
                            "deadline, drops); false: the mod passes through")
    mix: str = setting("lte:0.5,3g:0.5", "netem.mix", "link presets by fraction, "
                       "'lte:0.5,3g:0.5' (fractions sum to 1)")
    intermittent: float = setting(0.0, "netem.intermittent", "fraction of clients with on/off "
                                  "outages", _fraction())
    intermittent_mean_on_s: float = setting(120.0, "netem.intermittent_mean_on_s", "mean up "
                                            "time of intermittent links, seconds", _positive())
    intermittent_mean_off_s: float = setting(30.0, "netem.intermittent_mean_off_s", "mean "
                                             "outage of intermittent links, seconds",
                                             _positive())
    outage_policy: str = setting("fail", "netem.outage_policy", "what an outage does to a "
                                 "transfer of an intermittent client: resume (it pauses) or "
                                 "fail (it is lost)", Check(choices=OUTAGE_POLICIES))
    device_mix: str = setting("midrange:1.0", "netem.device_mix", "device presets by fraction, "
                              "'midrange:0.7,lowend:0.3'")
    availability: float = setting(0.0, "netem.availability", "per-round availability of every "
                                  "device; 0 = the presets' own", _fraction())
    seed: int = setting(0, "netem.seed", "scenario seed", Check(0))
    num_clients: int = setting(100, "netem.num_clients", "clients in the scenario (ids "
                               "0..num_clients-1; a run sets it from num_clients)", Check(1))
    deadline_s: float = setting(0.0, "netem.deadline_s", "round deadline in virtual seconds; "
                                "0 = none", Check(0.0))
    local_epochs: float = setting(1.0, "netem.local_epochs", "local epochs per round: virtual "
                                  "compute is num-examples * local_epochs samples", _positive())
    local_samples: int = setting(0, "netem.local_samples", "samples trained per round instead "
                                 "(local steps times batch size); 0 = num-examples * "
                                 "local_epochs", Check(0))
    compute_scale: float = setting(0.0, "netem.compute_scale", "factor on the device "
                                   "presets' per-sample compute (set for the small models); "
                                   "0 = derived from the model: its multiply-adds a sample "
                                   "forward / the small CNN's 3.02M, at least 1 "
                                   "(simulations.netem.compute)", Check(0.0))
    target_accuracy: float = setting(0.0, "netem.target_accuracy", "the accuracy of 'to "
                                     "target' (virtual seconds, wire bytes, joules) in "
                                     "summary.json, compare and the report; 0 = derived: in "
                                     "compare and the report dense FedAvg's last-10 accuracy "
                                     "(the first run's without a dense run), none in a "
                                     "single run", _fraction())
    stale_policy: str = setting("keep", "netem.stale_policy", "what happens to the residual of "
                                "a client away for rounds (simulations.netem.staleness)",
                                Check(choices=STALE_POLICIES))
    stale_decay: float = setting(0.5, "netem.stale_decay", "decay factor per round away beyond "
                                 "stale_after_rounds", Check(0.0, 1.0, low_open=True))
    stale_after_rounds: int = setting(0, "netem.stale_after_rounds", "rounds away tolerated "
                                      "before the stale policy acts", Check(0))
    trace_down: str = setting("", "netem.trace_down", "downlink trace file of the 'trace' link "
                              "preset (netem.mix=trace:1.0): Mahimahi (one integer ms "
                              "delivery opportunity of a 1500-byte packet per line, as "
                              "mm-link reads) or 't_seconds mbps' lines; loops; every client "
                              "reads it at its own phase")
    trace_up: str = setting("", "netem.trace_up", "uplink trace file of the 'trace' link "
                            "preset, as netem.trace_down")
    trace_latency_ms: float = setting(50.0, "netem.trace_latency_ms", "round-trip latency of "
                                      "the 'trace' link preset (the traces carry throughput "
                                      "only)", Check(0.0))
    protocol: str = setting(DEFAULT_PROTOCOL, "netem.protocol", "the profile charged on the "
                            "wire and the clock (docs/netem.md, 'A round's time from its "
                            "causes'): bridge-tls "
                            "(a phone through fedgc's bridge: held call, resident app), "
                            "supernode, supernode-tls, supernode-tls-phone (a Flower SuperNode: "
                            "a poll wait, a ClientApp process per message), "
                            "supernode-tls-devbox (the 2-core development machine's fit of "
                            "2026-12-04), a JSON file of one profile (the form of "
                            "simulations/netem/protocols.json), or none (the payload only, "
                            "no orchestration)")
    poll_interval_s: float | None = setting(None, "netem.poll_interval_s", "a node's poll "
                                            "interval: a message waits uniform [0, interval) "
                                            "for the next poll; 0 = a held call; empty = the "
                                            "profile's", Check(0.0))
    app_startup_s: float | None = setting(None, "netem.app_startup_s", "an app's start-up per "
                                          "message on the round's path (a ClientApp process); "
                                          "0 = a resident app; empty = the profile's",
                                          Check(0.0))
    server_measured: bool | None = setting(None, "netem.server_measured", "charge the "
                                           "server's work in the round's path (aggregation, "
                                           "the downlink's encoding) as measured in the run "
                                           "(the server thread's CPU seconds); empty = the "
                                           "profile's")
    server_s: float | None = setting(None, "netem.server_s", "fixed server seconds per round, "
                                     "on top of the measured work; empty = the profile's",
                                     Check(0.0))
    server_eval: bool = setting(False, "netem.server_eval", "with the server's work measured: "
                                "its central evaluation (for the report) on the clock too, "
                                "charged to the next round; false = off the clock")
    power_model: str = setting("", "netem.power_model", "JSON file of radio power models "
                               "laid over the presets (simulations.netem.energy: lte, 3g, "
                               "wifi from Huang et al., MobiSys 2012); empty = the presets")

    def __post_init__(self) -> None:
        hints = get_type_hints(type(self))
        for f in fields_of(type(self)):
            # Direct construction takes --set style strings too, as from_config does.
            object.__setattr__(self, f.name, coerce(f.metadata["key"], getattr(self, f.name),
                                                    hints[f.name]))
        validate(self)
        self._check_traces()
        self.power_models()  # a bad file is named now, before round 1
        self.protocol_model()
        for name, presets in (("mix", self.link_presets()), ("device_mix", DEVICE_PRESETS)):
            text = getattr(self, name)
            fractions = parse_fractions(text, name)
            unknown = sorted(set(fractions) - set(presets))
            if unknown:
                raise SettingsError(f"{PREFIX}{name} must be made of known presets "
                                    f"{sorted(presets)} (unknown: {unknown}), got {text!r}")
            if not math.isclose(sum(fractions.values()), 1.0, abs_tol=1e-6) or any(
                    f < 0 for f in fractions.values()):
                raise SettingsError(f"{PREFIX}{name} must be fractions >= 0 that sum to 1, "
                                    f"got {text!r}")

    def _check_traces(self) -> None:
        """Both trace files or neither, named by the mix when set; each one loads (cached)."""
        uses = TRACE_PRESET in parse_fractions(self.mix, "mix")
        given = [k for k in ("trace_down", "trace_up") if getattr(self, k)]
        if uses and len(given) < 2:
            missing = [PREFIX + k for k in ("trace_down", "trace_up") if k not in given]
            raise SettingsError(f"{PREFIX}mix = {self.mix!r} names the {TRACE_PRESET!r} link, "
                                f"which needs {' and '.join(missing)} (trace files)")
        if given and not uses:
            raise SettingsError(f"{', '.join(PREFIX + k for k in given)} set, but {PREFIX}mix = "
                                f"{self.mix!r} does not name the {TRACE_PRESET!r} link that "
                                f"replays them (e.g. {PREFIX}mix={TRACE_PRESET}:1.0)")
        for k in given:
            trace_file(PREFIX + k, getattr(self, k))

    def protocol_model(self) -> ProtocolModel | None:
        """The profile charged (None for ``none``: payload bytes only), with the parts the
        ``netem.*`` keys set (:data:`PROFILE_KEYS`) laid over it."""
        overrides = {field: getattr(self, key) for key, field in PROFILE_KEYS.items()
                     if getattr(self, key) is not None}
        if self.protocol == NO_PROTOCOL:
            if overrides:
                keys = ", ".join(PREFIX + k for k in PROFILE_KEYS if getattr(self, k) is not None)
                raise SettingsError(f"{keys} set, but {PREFIX}protocol = {NO_PROTOCOL!r} charges "
                                    f"the payload only; name a profile (e.g. "
                                    f"{PREFIX}protocol={DEFAULT_PROTOCOL})")
            return None
        return _profile(self.protocol, tuple(sorted(overrides.items())))

    def profile_file(self) -> str:
        """``netem.protocol`` as an absolute path when it names a file ("" for a profile of
        fedgc's or ``none``): the clients read the file themselves."""
        if self.protocol == NO_PROTOCOL or self.protocol in _protocols():
            return ""
        return os.path.abspath(self.protocol)

    def power_models(self) -> dict[str, RadioPowerModel]:
        """The radio power models: the presets, with ``power_model``'s file laid over them."""
        if not self.power_model:
            return dict(POWER_MODELS)
        try:
            return load_power_models(self.power_model)
        except PowerModelError as ex:
            raise SettingsError(f"{PREFIX}power_model = {self.power_model!r}: {ex}") from None

    def link_presets(self) -> dict[str, LinkProfile]:
        """The link presets ``mix`` may name: the built-in ones, and ``trace`` with the trace
        files when they are set."""
        if not (self.trace_down and self.trace_up):
            return dict(LINK_PRESETS)
        trace = LinkProfile(TRACE_PRESET, trace_file(PREFIX + "trace_down", self.trace_down),
                            trace_file(PREFIX + "trace_up", self.trace_up),
                            latency_ms=self.trace_latency_ms,
                            source=f"trace files {self.trace_down}, {self.trace_up}")
        return {**LINK_PRESETS, TRACE_PRESET: trace}

    # -- conversions --------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> NetemSettings:
        """Settings from the ``netem.*`` keys of ``config`` (other keys are ignored).

        An unknown ``netem.*`` key is an error naming it and the known keys.
        """
        known = {f.metadata["key"] for f in fields_of(cls)}
        values = {}
        for key, value in config.items():
            if not key.startswith(PREFIX) or key in (ROUND_KEY, ROUND_START_KEY):
                continue
            if key not in known:
                raise unknown_keys([key], known)
            values[key] = value
        return parse(cls, values)

    def to_config(self) -> dict[str, bool | int | float | str]:
        """The ``netem.*`` keys, typed, for a Flower ConfigRecord (a key left to the profile
        is "")."""
        return to_flat(self)

    @property
    def compute_factor(self) -> float:
        """The factor on the presets' compute: ``compute_scale``, or 1 while it is 0 (derived,
        but not yet from a model: :func:`simulations.netem.integration.for_run` derives it)."""
        return self.compute_scale if self.compute_scale > 0 else 1.0

    @property
    def deadline(self) -> float:
        """The deadline for :class:`~simulations.netem.clock.RoundClock` (``inf`` when none)."""
        return self.deadline_s if self.deadline_s > 0 else math.inf

    @property
    def stale(self) -> StalePolicy:
        """The stale-residual policy."""
        return StalePolicy(self.stale_policy, self.stale_decay, self.stale_after_rounds)

    def scenario_key(self) -> tuple:
        """The fields that define the client -> (link, device) mapping."""
        return (self.mix, self.intermittent, self.intermittent_mean_on_s,
                self.intermittent_mean_off_s, self.outage_policy, self.device_mix,
                self.availability, self.seed, self.num_clients, self.trace_down, self.trace_up,
                self.trace_latency_ms)

    def assignment(self) -> Assignment:
        """Build the scenario's assignment (cached per process by :func:`assignment_for`)."""
        return assign(self.num_clients, parse_fractions(self.mix, "mix"), self.seed,
                      intermittent=self.intermittent,
                      intermittent_mean_on_s=self.intermittent_mean_on_s,
                      intermittent_mean_off_s=self.intermittent_mean_off_s,
                      outage_policy=self.outage_policy,
                      device_mix=parse_fractions(self.device_mix, "device_mix"),
                      availability=self.availability or None,
                      link_presets=self.link_presets())


def profile_line(settings: NetemSettings) -> str:
    """The charged profile in words, for a run's header and log: its name and orchestration
    (``none``: the payload only)."""
    model = settings.protocol_model()
    if model is None:
        return f"{NO_PROTOCOL} (the payload only: no protocol bytes, no orchestration)"
    name = settings.protocol if settings.profile_file() == "" else \
        f"{model.name} (from {settings.protocol})"
    changed = [PREFIX + k for k in PROFILE_KEYS if getattr(settings, k) is not None]
    return (f"{name}: {model.orchestration()}"
            + (f" ({', '.join(changed)} set)" if changed else "")
            + (", central evaluation on the clock" if settings.server_eval
               and model.server_measured else ""))


_ASSIGNMENTS: dict[tuple, Assignment] = {}


def assignment_for(settings: NetemSettings) -> Assignment:
    """The (process-wide cached) assignment of ``settings``' scenario."""
    key = settings.scenario_key()
    hit = _ASSIGNMENTS.get(key)
    if hit is None:
        if len(_ASSIGNMENTS) >= 8:
            _ASSIGNMENTS.pop(next(iter(_ASSIGNMENTS)))
        hit = _ASSIGNMENTS[key] = settings.assignment()
    return hit


_TRACES: dict[tuple[str, int, int], Trace] = {}


@lru_cache(maxsize=1)
def _protocols() -> dict[str, ProtocolModel]:
    """fedgc's profiles (``protocols.json``), read once per process."""
    try:
        return load_protocols()
    except ProtocolError as ex:
        raise SettingsError(f"{PREFIX}protocol: {ex}") from None


def _profile(name: str, overrides: tuple[tuple[str, Any], ...]) -> ProtocolModel:
    """Profile ``name`` (fedgc's, or a JSON file of one), with ``overrides`` laid over it."""
    models = _protocols()
    if name in models:
        base = models[name]
    else:
        base = profile_file(name)
    return dataclasses.replace(base, **dict(overrides)) if overrides else base


_PROFILE_FILES: dict[tuple[str, int, int], ProtocolModel] = {}


def profile_file(path: str) -> ProtocolModel:
    """The one profile of JSON file ``path`` (cached per process while the file is unchanged);
    a missing or unreadable file, bad JSON, a missing, unknown or negative field, or a file of
    several profiles is a :class:`SettingsError` naming ``netem.protocol`` and the file."""
    key = PREFIX + "protocol"
    known = sorted(_protocols())
    try:
        stat = os.stat(path)
    except OSError as ex:
        raise SettingsError(f"{key} = {path!r} is neither {NO_PROTOCOL!r}, a profile of "
                            f"fedgc's {known}, nor a readable file ({ex.strerror or ex})") \
            from None
    if not Path(path).is_file():
        raise SettingsError(f"{key} = {path!r} is not a file; expected a JSON file of one "
                            f"profile (the form of simulations/netem/protocols.json) or one "
                            f"of {known}")
    cache_key = (os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
    hit = _PROFILE_FILES.get(cache_key)
    if hit is None:
        try:
            profiles = load_protocols(path)
        except ProtocolError as ex:
            raise SettingsError(f"{key} = {path!r}: {ex}") from None
        if len(profiles) != 1:
            raise SettingsError(f"{key} = {path!r} holds {len(profiles)} profiles "
                                f"({sorted(profiles)}); keep the one to charge in the file")
        (hit,) = profiles.values()
        if len(_PROFILE_FILES) >= 8:
            _PROFILE_FILES.pop(next(iter(_PROFILE_FILES)))
        _PROFILE_FILES[cache_key] = hit
    return hit


def trace_file(key: str, path: str) -> Trace:
    """The trace in file ``path`` (cached per process while the file is unchanged); a missing,
    unreadable or malformed file is a :class:`SettingsError` naming ``key`` and the file."""
    try:
        stat = os.stat(path)
    except OSError as ex:
        raise SettingsError(f"{key} = {path!r}: cannot read the trace file "
                            f"({ex.strerror or ex})") from None
    if not Path(path).is_file():
        raise SettingsError(f"{key} = {path!r} is not a file; expected a Mahimahi trace")
    cache_key = (os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
    hit = _TRACES.get(cache_key)
    if hit is None:
        try:
            hit = load_trace(path)
        except NetemError as ex:
            raise SettingsError(f"{key} = {path!r}: {ex}") from None
        except UnicodeDecodeError:
            raise SettingsError(f"{key} = {path!r} is not a text trace file") from None
        if len(_TRACES) >= 8:
            _TRACES.pop(next(iter(_TRACES)))
        _TRACES[cache_key] = hit
    return hit


def parse_fractions(text: str, name: str) -> dict[str, float]:
    """``"lte:0.5,3g:0.5"`` -> ``{"lte": 0.5, "3g": 0.5}``, naming ``netem.<name>`` on error."""
    out: dict[str, float] = {}
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        preset, sep, frac = part.rpartition(":")
        try:
            value = float(frac)
        except ValueError:
            value = math.nan
        if not sep or not preset or not math.isfinite(value):
            raise SettingsError(f"{PREFIX}{name} must look like 'preset:fraction,...', "
                                f"got {text!r} (bad part {part!r})")
        if preset in out:
            raise SettingsError(f"{PREFIX}{name} names {preset!r} twice in {text!r}")
        out[preset.strip()] = value
    if not out:
        raise SettingsError(f"{PREFIX}{name} must name at least one preset, got {text!r}")
    return out
