"""SLO intents: what the operator wants of the stack at each time of the week, and which layouts meet it now.

An intents file (TOML or JSON) states per weekly window the targets (p99 TTFT, TPOT, a utilization floor) and a
priority, plus a freeze budget for switches and an allow-list of layouts. An LLM may draft one from a sentence, so
validation is strict: unknown keys, malformed times, overlapping windows, values out of range, strings for numbers and
layouts that do not parse are errors naming the field. Times outside every window fall in the default window: no
targets, priority "latency". `select_layouts` returns the layouts that meet the active window under the expected
demand, ordered by its priority: the `allowed` of the policy's `decide`.
"""

from __future__ import annotations

import difflib
import json
import re
import tomllib
from dataclasses import dataclass
from datetime import datetime
from itertools import combinations, product
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from services.controller.autopilot.profile import LayoutModel, Profile
from services.topology.topology import Topology, TopologyError

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
MINUTES_PER_DAY, MINUTES_PER_WEEK = 24 * 60, 7 * 24 * 60
_TIME = r"^([01][0-9]|2[0-3]):[0-5][0-9]$"
_STRICT = ConfigDict(extra="forbid", frozen=True)
Milliseconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class IntentError(ValueError):
    """Intents that do not validate; the message names each bad field and says why."""


def _minutes(text: str, *, is_end: bool) -> int:
    """Minutes after midnight of "HH:MM" (24:00 only as an end: the midnight that ends the day)."""
    if is_end and text == "24:00":
        return MINUTES_PER_DAY
    if not re.fullmatch(_TIME, text):
        raise ValueError(f"expected a 24-hour local time \"HH:MM\" (00:00-23:59{', or 24:00' * is_end}), got {text!r}")
    return int(text[:2]) * 60 + int(text[3:])


def _when(minute_of_week: int) -> str:
    minute = minute_of_week % MINUTES_PER_WEEK
    return f"{DAYS[minute // MINUTES_PER_DAY]} {minute % MINUTES_PER_DAY // 60:02d}:{minute % 60:02d}"


class Window(BaseModel):
    """A weekly time window: its SLO targets and what to favour among the layouts that meet them."""

    model_config = _STRICT
    name: str = Field(min_length=1, max_length=64, description="unique name, e.g. peak_hours")
    start: str = Field(description="local time HH:MM at which the window opens", json_schema_extra={"pattern": _TIME})
    end: str = Field(description="local time HH:MM at which it closes (exclusive, 24:00 is midnight); earlier than "
                     "start: the window wraps past midnight", json_schema_extra={"pattern": f"^({_TIME[1:-1]}|24:00)$"})
    days: tuple[Literal["mon", "tue", "wed", "thu", "fri", "sat", "sun"], ...] = Field(
        DAYS, min_length=1, description="days on which it opens (default: all); a wrapping window ends the next day")
    p99_ttft_ms: Milliseconds | None = Field(None, description="target p99 time to first token, milliseconds")
    tpot_ms: Milliseconds | None = Field(None, description="target time per output token of a request, milliseconds")
    min_utilization: float | None = Field(None, ge=0, le=1, allow_inf_nan=False, description="utilization floor "
                                          "0..1: layouts whose capacity leaves the expected load under it are not used")
    priority: Literal["latency", "throughput", "cost"] = Field(
        "latency", description="what orders the layouts that meet the targets: latency (lowest TPOT), throughput "
        "(highest capacity), cost (fewest workers); 'efficiency' is read as cost")

    @field_validator("priority", mode="before")
    @classmethod
    def _efficiency_is_cost(cls, value: object) -> object:
        return "cost" if value == "efficiency" else value

    @field_validator("start", "end")
    @classmethod
    def _time(cls, text: str, info: ValidationInfo) -> str:
        _minutes(text, is_end=info.field_name == "end")
        return text

    @model_validator(mode="after")
    def _days_and_length(self) -> Window:
        if len(set(self.days)) != len(self.days):
            raise ValueError(f"days: a day is listed twice in {list(self.days)}")
        if _minutes(self.start, is_end=False) == _minutes(self.end, is_end=True):
            raise ValueError(f"start and end are both {self.start}, so the window has no length (a whole day is "
                             "start = \"00:00\", end = \"24:00\")")
        return self

    def spans(self) -> list[tuple[int, int]]:
        """The minute-of-week intervals [begin, end) it covers (Monday 00:00 is 0), split at the end of the week."""
        start, end = _minutes(self.start, is_end=False), _minutes(self.end, is_end=True)
        length = (end - start) % MINUTES_PER_DAY or MINUTES_PER_DAY
        spans = []
        for begin in (DAYS.index(day) * MINUTES_PER_DAY + start for day in self.days):
            spans.append((begin, min(begin + length, MINUTES_PER_WEEK)))
            if begin + length > MINUTES_PER_WEEK:  # sunday night into monday morning
                spans.append((0, begin + length - MINUTES_PER_WEEK))
        return spans


DEFAULT_WINDOW = Window(name="default", start="00:00", end="24:00")  # outside every window: no targets, latency


class Intents(BaseModel):
    """The operator's SLO intents; `Intents.model_json_schema()` is what an LLM drafting them is shown."""

    model_config = _STRICT
    reconfiguration_budget_ms: float | None = Field(None, ge=0, allow_inf_nan=False, description="a switch whose "
                                                    "measured freeze exceeds this many milliseconds is not taken")
    layouts: tuple[str, ...] | None = Field(None, min_length=1, description="the layouts that may be used, e.g. "
                                            "[\"tp4pp1\", \"tp1pp4\"] (default: every profiled one)")
    windows: tuple[Window, ...] = Field((), description="non-overlapping weekly windows; the times outside them have "
                                        "no targets and priority latency")

    @field_validator("layouts")
    @classmethod
    def _known_layouts(cls, layouts: tuple[str, ...] | None) -> tuple[str, ...] | None:
        try:
            names = None if layouts is None else tuple(str(Topology.parse(text)) for text in layouts)
        except TopologyError as error:
            raise ValueError(str(error)) from None
        if names is not None and len(set(names)) != len(names):
            raise ValueError(f"a layout is listed twice: {list(layouts)}")
        return names

    @model_validator(mode="after")
    def _windows_apart(self) -> Intents:
        names = [w.name for w in self.windows]
        if DEFAULT_WINDOW.name in names:
            raise ValueError("windows: the name 'default' is reserved for the times outside every window")
        if len(set(names)) != len(names):
            raise ValueError(f"windows: names must be unique, got {names}")
        for first, second in combinations(self.windows, 2):
            for (begin_a, end_a), (begin_b, end_b) in product(first.spans(), second.spans()):
                if max(begin_a, begin_b) < min(end_a, end_b):
                    raise ValueError(f"windows {first.name!r} and {second.name!r} overlap: both cover "
                                     f"{_when(max(begin_a, begin_b))} to {_when(min(end_a, end_b))}")
        return self

    def window_at(self, when: datetime) -> Window:
        """The window active at `when`'s wall-clock time (the default window outside all of them)."""
        minute = when.weekday() * MINUTES_PER_DAY + when.hour * 60 + when.minute
        return next((w for w in self.windows if any(b <= minute < e for b, e in w.spans())), DEFAULT_WINDOW)


# ---- loading ---------------------------------------------------------------------------------------------------------
def _describe(error: dict, data: dict) -> str:
    """One validation error as `field.path: why`, with the window's name and, for a typo, the key it resembles."""
    loc, path = error["loc"], ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    if loc[:1] == ("windows",) and len(loc) >= 2 and isinstance(entry := data["windows"][loc[1]], dict) \
            and isinstance(name := entry.get("name"), str):
        path = path.replace(f"windows[{loc[1]}]", f"windows[{loc[1]}] ({name!r})", 1)
    if error["type"] == "extra_forbidden":
        fields = list((Window if len(loc) == 3 and loc[0] == "windows" else Intents).model_fields)
        near = difflib.get_close_matches(str(loc[-1]), fields, n=1)
        return f"{path}: unknown key ({f'did you mean {near[0]!r}?' if near else 'known: ' + ', '.join(fields)})"
    message = "required, missing" if error["type"] == "missing" else error["msg"].removeprefix("Value error, ")
    if error["type"] not in ("value_error", "missing") and not isinstance(error["input"], dict | list):
        message += f", got {error['input']!r}"
    return f"{path}: {message}" if path else message


def parse_intents(data: object, source: str = "intents") -> Intents:
    """Validate decoded intents (a TOML table or a JSON object); IntentError says what is wrong and where."""
    if not isinstance(data, dict):
        raise IntentError(f"{source}: expected a table of intents, got {type(data).__name__}")
    try:  # strict JSON validation: "500" is not a number; TOML times become strings the HH:MM check rejects
        return Intents.model_validate_json(json.dumps(data, default=str), strict=True)
    except ValidationError as exc:
        errors = exc.errors()  # an error inside a field, not also the field's follow-on one (a list left empty)
        problems = [_describe(e, data) for e in errors
                    if not any(len(o["loc"]) > len(e["loc"]) and o["loc"][:len(e["loc"])] == e["loc"] for o in errors)]
    raise IntentError(f"{source}: {problems[0]}" if len(problems) == 1 else
                      f"{source}: {len(problems)} problems" + "".join(f"\n  - {p}" for p in problems))


def load_intents(path: str | Path) -> Intents:
    """Read and validate an intents file, TOML or JSON by its suffix."""
    path = Path(path)
    if path.suffix not in (".toml", ".json"):
        raise IntentError(f"{path}: unknown format {path.suffix!r}: intents are a .toml or a .json file")
    try:
        data = (tomllib.loads if path.suffix == ".toml" else json.loads)(path.read_text())
    except OSError as exc:
        raise IntentError(f"{path}: cannot read it: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise IntentError(f"{path}: not valid {path.suffix[1:].upper()}: {exc}") from None
    return parse_intents(data, str(path))


# ---- selection -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Demand:
    """What the stack is expected to serve (the router's recent view, or a forecast)."""

    load: float            # requests in flight
    context: float         # mean tokens a running request attends over
    prompt_tokens: float   # mean prompt length: the prefill before the first token
    arrival_rate: float = 0.0  # requests/s: their prefills must leave the layout time to decode


@dataclass(frozen=True, slots=True)
class Prediction:
    """What the profile predicts for one layout under the demand."""

    max_requests: int      # requests of the demand's context its KV holds
    tpot_s: float
    ttft_s: float          # prefill + one decode step: a lower bound of p99 TTFT (queueing not counted)
    utilization: float     # tokens/s the load needs / tokens/s with its KV full
    switch_ms: float       # measured freeze of a switch from the live layout (0 for the live one)
    overloaded: str = ""   # why requests would queue without bound ("" when they would not)


@dataclass(frozen=True, slots=True)
class Selection:
    """The layouts the active window allows, best first by its priority, and why each other one is rejected."""

    window: str
    priority: str
    allowed: tuple[str, ...]
    chosen: str | None
    rejected: dict[str, str]
    predictions: dict[str, Prediction]
    note: str = ""         # set when no layout meets the intent: `allowed` is then the fallback alone
    tpot_target_s: float | None = None  # the window's TPOT target (the policy's guard against switches for TPOT)
    within_budget: tuple[str, ...] = ()  # the intent's profiled layouts a switch from the live one may take

    @property
    def is_met(self) -> bool:
        return not self.note


def _predict(model: LayoutModel, demand: Demand, switch_ms: float) -> Prediction:
    max_requests = model.max_requests(demand.context)
    tpot, prefill = model.tpot(demand.load, demand.context), model.prefill(demand.prompt_tokens)
    overloaded = ""
    if demand.load > max_requests:
        overloaded = f"overloaded: KV holds {max_requests} requests, {demand.load:.0f} in flight"
    elif demand.arrival_rate * prefill >= 1:
        overloaded = f"overloaded: {demand.arrival_rate:.1f} prefills/s of {prefill * 1e3:.0f} ms fill all its time"
    utilization = demand.load / tpot / model.throughput(max_requests, demand.context)
    return Prediction(max_requests, tpot, prefill + tpot, utilization, switch_ms, overloaded)


def _misses(window: Window, budget_ms: float | None, live: str, name: str, p: Prediction, demand: Demand) -> list[str]:
    """Why the layout fails the window (empty: it meets it)."""
    misses = []
    if p.max_requests < demand.load:
        misses.append(f"KV holds {p.max_requests} requests of {demand.context:.0f} tokens, {demand.load:.0f} expected")
    if window.tpot_ms is not None and p.tpot_s > window.tpot_ms / 1000:
        misses.append(f"TPOT {p.tpot_s * 1e3:.1f} ms > target {window.tpot_ms:g} ms")
    if window.p99_ttft_ms is not None and (p.overloaded or p.ttft_s > window.p99_ttft_ms / 1000):
        misses.append(f"p99 TTFT unbounded ({p.overloaded})" if p.overloaded else
                      f"p99 TTFT >= {p.ttft_s * 1e3:.0f} ms before queueing > target {window.p99_ttft_ms:g} ms")
    if budget_ms is not None and name != live and p.switch_ms > budget_ms:
        misses.append(f"switch from {live} costs {p.switch_ms:.0f} ms, budget {budget_ms:g} ms")
    if window.min_utilization is not None and p.utilization < window.min_utilization:
        misses.append(f"utilization {p.utilization:.0%} < floor {window.min_utilization:.0%}")
    return misses


def _priority_key(priority: str, name: str, model: LayoutModel, p: Prediction, context: float) -> tuple:
    """latency: lowest TPOT first; throughput: highest throughput with the KV full; cost: fewest workers."""
    return {"latency": (p.tpot_s, model.num_workers, name), "cost": (model.num_workers, p.tpot_s, name),
            "throughput": (-model.throughput(p.max_requests, context), p.tpot_s, name)}[priority]


def select_layouts(intents: Intents, profile: Profile, when: datetime, demand: Demand, live: str) -> Selection:
    """The layouts that meet the window active at `when` under `demand`, by its priority. When none does, the one
    that misses least: one whose KV holds the load (else the one holding the most requests), then one within the
    switch budget, then the fewest missed targets, then the window's priority order."""
    window, budget = intents.window_at(when), intents.reconfiguration_budget_ms
    names = [n for n in intents.layouts or profile.layouts if n in profile.layouts]
    rejected = {n: "not in the profile: calibrate it" for n in intents.layouts or () if n not in profile.layouts}
    predictions = {n: _predict(profile.layouts[n], demand,
                               0.0 if n == live else profile.switch_cost(live, n).downtime_s * 1000) for n in names}
    misses = {n: _misses(window, budget, live, n, predictions[n], demand) for n in names}
    rank = {n: _priority_key(window.priority, n, profile.layouts[n], predictions[n], demand.context) for n in names}
    passing = sorted((n for n in names if not misses[n]), key=rank.__getitem__)
    rejected |= {n: "; ".join(m) for n, m in misses.items() if m}
    common = dict(window=window.name, priority=window.priority, rejected=rejected, predictions=predictions,
                  tpot_target_s=window.tpot_ms / 1000 if window.tpot_ms is not None else None,
                  within_budget=tuple(n for n in names if budget is None or n == live
                                      or predictions[n].switch_ms <= budget))
    if passing:
        return Selection(allowed=tuple(passing), chosen=passing[0], **common)
    if not names:
        return Selection(allowed=(), chosen=None, note="no layout of the intent is in the profile", **common)

    def shortfall(n: str) -> tuple:
        p = predictions[n]
        over_budget = budget is not None and n != live and p.switch_ms > budget
        return (p.max_requests < demand.load, -min(p.max_requests, demand.load), over_budget, len(misses[n]), rank[n])

    fallback = min(names, key=shortfall)
    note = (f"no layout meets the intent of window {window.name!r}; {fallback} misses least ({rejected[fallback]}): "
            f"KV for the load first, then the switch budget, then the fewest missed targets, then {window.priority}")
    return Selection(allowed=(fallback,), chosen=fallback, note=note, **common)

