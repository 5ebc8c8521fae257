"""SLO intents: the schema and its errors, the active window, layout selection against a hand-built profile, and
`reconfigctl intent check|draft` (draft against a fake OpenAI-compatible endpoint served by http.server)."""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
import tomllib
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.controller.autopilot.intent_cli import (
    EXAMPLE_INTENTS,
    add_intent_parser,
    first_json_object,
    format_selection,
    intent_command,
    to_toml,
)
from services.controller.autopilot.intents import (
    DEFAULT_WINDOW,
    Demand,
    IntentError,
    Intents,
    load_intents,
    parse_intents,
    select_layouts,
)
from services.controller.autopilot.loop import Autopilot, AutopilotConfig
from services.controller.autopilot.observation import Observation
from services.controller.autopilot.profile import LayoutModel, Profile, SwitchSample

EXAMPLE_TOML = """
reconfiguration_budget_ms = 500      # a switch whose measured freeze exceeds it is not taken (optional)
layouts = ["tp4pp1", "tp1pp4"]       # optional allow-list of candidate layouts (default: every profiled one)

[[windows]]
name = "peak_hours"
start = "09:00"                      # local time, HH:MM; a window may wrap midnight (start > end)
end = "18:00"
days = ["mon", "tue", "wed", "thu", "fri"]   # optional; default every day
p99_ttft_ms = 2000                   # optional targets
tpot_ms = 150
priority = "latency"                 # latency | throughput | cost  ("efficiency" accepted as an alias of cost)

[[windows]]
name = "off_peak_hours"
start = "18:00"
end = "09:00"
min_utilization = 0.4                # utilization floor (0..1): layouts whose capacity leaves the load under it fail
priority = "cost"
"""
MONDAY = datetime(2024, 1, 1)  # a Monday, 00:00


def at(day: int, hour: int, minute: int = 0) -> datetime:
    return MONDAY + timedelta(days=day, hours=hour, minutes=minute)


def example() -> dict:
    return tomllib.loads(EXAMPLE_TOML)


# ---- schema ----------------------------------------------------------------------------------------------------------
def test_the_example_parses_and_json_equals_toml(tmp_path):
    (tmp_path / "intents.toml").write_text(EXAMPLE_TOML)
    (tmp_path / "intents.json").write_text(json.dumps(example()))
    intents = load_intents(tmp_path / "intents.toml")
    assert intents == load_intents(tmp_path / "intents.json")
    assert intents.reconfiguration_budget_ms == 500 and intents.layouts == ("tp4pp1", "tp1pp4")
    peak, off_peak = intents.windows
    assert (peak.p99_ttft_ms, peak.tpot_ms, peak.priority, peak.days) == (2000, 150, "latency", ("mon", "tue", "wed",
                                                                                               "thu", "fri"))
    assert (off_peak.min_utilization, off_peak.priority, len(off_peak.days)) == (0.4, "cost", 7)
    assert "windows" in Intents.model_json_schema()["properties"]


def test_efficiency_is_cost_and_layouts_are_normalized():
    data = example() | {"layouts": ["TP4PP1", "pp4tp1"]}
    data["windows"][1]["priority"] = "efficiency"
    intents = parse_intents(data)
    assert intents.windows[1].priority == "cost" and intents.layouts == ("tp4pp1", "tp1pp4")


def mutated(path: tuple, value: object) -> dict:
    data = example()
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


@pytest.mark.parametrize("data, expected", [
    (mutated(("windows", 0, "p99_ttf_ms"), 5), ["windows[0] ('peak_hours').p99_ttf_ms", "unknown key",
                                                 "did you mean 'p99_ttft_ms'"]),
    (mutated(("budget_ms",), 5), ["budget_ms: unknown key"]),
    (mutated(("windows", 0, "start"), "9am"), ["windows[0] ('peak_hours').start", "HH:MM", "'9am'"]),
    (mutated(("windows", 0, "end"), "18:60"), [".end", "'18:60'"]),
    (mutated(("windows", 0, "end"), "09:00"), ["windows[0] ('peak_hours')", "start and end are both 09:00"]),
    (mutated(("windows", 1, "end"), "10:00"), ["windows 'peak_hours' and 'off_peak_hours' overlap",
                                               "mon 09:00 to mon 10:00"]),
    (mutated(("windows", 1, "min_utilization"), 1.5), ["off_peak_hours').min_utilization", "less than or equal to 1",
                                                        "1.5"]),
    (mutated(("windows", 1, "min_utilization"), -0.1), [".min_utilization", "greater than or equal to 0"]),
    (mutated(("windows", 1, "priority"), "fast"), [".priority", "'latency', 'throughput' or 'cost'", "'fast'"]),
    (mutated(("windows", 0, "tpot_ms"), "150"), [".tpot_ms", "valid number", "'150'"]),
    (mutated(("windows", 0, "tpot_ms"), 0), [".tpot_ms", "greater than 0"]),
    (mutated(("windows", 0, "days"), ["mon", "monday"]), [".days[1]", "'monday'"]),
    (mutated(("windows", 0, "days"), ["mon", "mon"]), ["listed twice"]),
    (mutated(("windows", 1, "name"), "peak_hours"), ["names must be unique"]),
    (mutated(("windows", 1, "name"), "default"), ["'default' is reserved"]),
    (mutated(("layouts",), ["tp4pp1", "tp2"]), []),  # valid: a missing degree is 1
    (mutated(("layouts",), ["tp4pp1", "tp4"]), ["layouts: a layout is listed twice"]),
    (mutated(("layouts",), ["tp4pp1", "4x1"]), ["layouts", "invalid topology '4x1'"]),
    (mutated(("reconfiguration_budget_ms",), True), ["reconfiguration_budget_ms", "valid number"]),
])
def test_invalid_intents_name_the_field(data, expected):
    if not expected:
        parse_intents(data)
        return
    with pytest.raises(IntentError) as error:
        parse_intents(data, "intents.toml")
    message = str(error.value)
    assert message.startswith("intents.toml: ")
    for part in expected:
        assert part in message


def test_several_problems_are_listed_and_files_are_checked(tmp_path):
    data = mutated(("windows", 0, "start"), "9")
    data["windows"][1]["priority"] = "fast"
    with pytest.raises(IntentError, match=r"2 problems\n  - windows\[0\].*start.*\n  - windows\[1\].*priority"):
        parse_intents(data)
    (tmp_path / "bad.toml").write_text("layouts = [")
    (tmp_path / "intents.yaml").write_text("")
    (tmp_path / "time.toml").write_text('[[windows]]\nname = "a"\nstart = 09:00:00\nend = "10:00"\n')
    for name, expected in [("bad.toml", "not valid TOML"), ("intents.yaml", "unknown format '.yaml'"),
                           ("missing.json", "cannot read it"), ("time.toml", "got '09:00:00'")]:
        with pytest.raises(IntentError, match=expected):
            load_intents(tmp_path / name)
    assert issubclass(IntentError, ValueError)


def test_windows_wrap_midnight_and_follow_their_days():
    intents = parse_intents(example())
    assert intents.window_at(at(0, 10)).name == "peak_hours"
    assert intents.window_at(at(0, 17, 59)).name == "peak_hours"
    assert intents.window_at(at(0, 18)).name == "off_peak_hours"
    assert intents.window_at(at(1, 3)).name == "off_peak_hours"      # monday's night, wrapped into tuesday
    assert intents.window_at(at(5, 12)).name == "default"            # saturday daytime: outside both
    assert intents.window_at(at(6, 23, 30)).name == "off_peak_hours"
    assert intents.window_at(at(0, 8, 59)).name == "off_peak_hours"  # sunday's night, wrapped over the week's end
    friday_night = parse_intents({"windows": [{"name": "late", "start": "22:00", "end": "02:00", "days": ["fri"]},
                                              {"name": "sunday", "start": "23:00", "end": "01:00", "days": ["sun"]}]})
    assert friday_night.window_at(at(5, 1)).name == "late"             # saturday 01:00: friday's window
    assert friday_night.window_at(at(4, 1)).name == "default"          # friday 01:00: thursday opened none
    assert friday_night.window_at(at(0, 0, 30)).name == "sunday"       # monday 00:30: sunday's window
    whole_day = parse_intents({"windows": [{"name": "weekend", "start": "00:00", "end": "24:00",
                                            "days": ["sat", "sun"]}]})
    assert [whole_day.window_at(at(d, h)).name for d, h in [(4, 23), (5, 0), (6, 23), (0, 0)]] == \
        ["default", "weekend", "weekend", "default"]
    with pytest.raises(IntentError, match="'a' and 'b' overlap: both cover mon 00:30 to mon 01:00"):
        parse_intents({"windows": [{"name": "a", "start": "23:00", "end": "01:00", "days": ["sun"]},
                                   {"name": "b", "start": "00:30", "end": "02:00", "days": ["mon"]}]})
    assert DEFAULT_WINDOW.priority == "latency" and DEFAULT_WINDOW.tpot_ms is None


# ---- selection -------------------------------------------------------------------------------------------------------
def layout(name: str, step_ms: float, per_request_ms: float, prefill_ms_per_token: float, kv_blocks: int,
           num_workers: int) -> LayoutModel:
    return LayoutModel(name, step_ms / 1e3, per_request_ms / 1e3, 0.0, 0.01, prefill_ms_per_token / 1e3, kv_blocks,
                       16, num_workers)


# At context 160 (10 blocks a request): tp4pp1 holds 50 requests, tp1pp4 100, tp1pp2 20. At load 10 the TPOTs are
# 15, 32 and 31 ms; the throughputs with the KV full 1429, 2000 and 541 tokens/s.
LAYOUTS = (layout("tp4pp1", 10, 0.5, 0.05, 500, 4), layout("tp1pp4", 30, 0.2, 0.2, 1000, 4),
           layout("tp1pp2", 25, 0.6, 0.3, 200, 2))
SWITCHES = (SwitchSample("tp4pp1", "tp1pp4", 0.3), SwitchSample("tp4pp1", "tp1pp2", 0.8),
            SwitchSample("tp1pp4", "tp1pp2", 0.1), SwitchSample("tp1pp4", "tp4pp1", 0.2))
PROFILE = Profile("llama", "test", {m.layout: m for m in LAYOUTS}, {(s.source, s.target): s for s in SWITCHES})
LOAD_10 = Demand(load=10, context=160, prompt_tokens=1000)


def select(window: dict | None = None, demand: Demand = LOAD_10, live: str = "tp4pp1", **top) -> object:
    windows = [{"name": "w", "start": "00:00", "end": "24:00"} | window] if window is not None else []
    return select_layouts(parse_intents({"windows": windows} | top), PROFILE, at(0, 12), demand, live)


def test_kv_rejects_the_layouts_that_cannot_hold_the_load():
    selection = select(demand=Demand(load=60, context=160, prompt_tokens=1000))
    assert selection.allowed == ("tp1pp4",) and selection.chosen == "tp1pp4" and selection.is_met
    assert selection.rejected["tp4pp1"] == "KV holds 50 requests of 160 tokens, 60 expected"
    assert selection.rejected["tp1pp2"].startswith("KV holds 20 requests")


def test_tpot_and_ttft_targets():
    assert select({"tpot_ms": 20}).allowed == ("tp4pp1",)
    assert select({"tpot_ms": 20}).rejected["tp1pp4"] == "TPOT 32.0 ms > target 20 ms"
    assert select({"tpot_ms": 20}).tpot_target_s == pytest.approx(0.02)  # the policy's guard
    assert select({"p99_ttft_ms": 250}).tpot_target_s is None and select().tpot_target_s is None
    # TTFT >= prefill + one step: 10 + 50 + 15 = 75 ms, 10 + 200 + 32 = 242 ms, 10 + 300 + 31 = 341 ms
    ttft = select({"p99_ttft_ms": 250})
    assert ttft.allowed == ("tp4pp1", "tp1pp4") and "p99 TTFT >= 341 ms before queueing > target 250 ms" in \
        ttft.rejected["tp1pp2"]
    assert ttft.predictions["tp4pp1"].ttft_s == pytest.approx(0.075)
    # 5 prompts/s of 210 ms of prefill each: tp1pp4 has no time left to decode, so its queue grows without bound
    busy = select({"p99_ttft_ms": 250}, demand=Demand(10, 160, 1000, arrival_rate=5))
    assert busy.allowed == ("tp4pp1",) and "p99 TTFT unbounded (overloaded" in busy.rejected["tp1pp4"]


def test_budget_uses_the_measured_switch_from_the_live_layout():
    from_tp4 = select(reconfiguration_budget_ms=500)
    assert from_tp4.rejected == {"tp1pp2": "switch from tp4pp1 costs 800 ms, budget 500 ms"}
    assert from_tp4.predictions["tp1pp4"].switch_ms == pytest.approx(300)
    assert set(select(reconfiguration_budget_ms=500, live="tp1pp4").allowed) == set(PROFILE.layouts)  # 100 ms
    # tp1pp2 -> tp4pp1 was never measured: the slowest measured switch into tp4pp1 (200 ms) stands in
    assert select(reconfiguration_budget_ms=150, live="tp1pp2").rejected["tp4pp1"] == \
        "switch from tp1pp2 costs 200 ms, budget 150 ms"
    assert "tp4pp1" in select(reconfiguration_budget_ms=0).allowed  # staying costs no switch


def test_utilization_floor():
    # load 10: demand 10/15ms = 667 of 1429 tokens/s (47%), 312 of 2000 (16%), 323 of 541 (60%)
    selection = select({"min_utilization": 0.4})
    assert selection.rejected == {"tp1pp4": "utilization 16% < floor 40%"}
    assert selection.predictions["tp4pp1"].utilization == pytest.approx((10 / 0.015) / (50 / 0.035))
    assert select({"min_utilization": 0.5}).allowed == ("tp1pp2",)


@pytest.mark.parametrize("priority, order", [("latency", ("tp4pp1", "tp1pp2", "tp1pp4")),
                                             ("throughput", ("tp1pp4", "tp4pp1", "tp1pp2")),
                                             ("cost", ("tp1pp2", "tp4pp1", "tp1pp4")),
                                             ("efficiency", ("tp1pp2", "tp4pp1", "tp1pp4"))])
def test_priority_orders_the_allowed_layouts(priority, order):
    selection = select({"priority": priority})
    assert selection.allowed == order and selection.chosen == order[0] and not selection.rejected


def test_allow_list_and_unprofiled_layouts():
    selection = select(layouts=["tp1pp4", "tp2pp2"])
    assert selection.allowed == ("tp1pp4",) and set(selection.predictions) == {"tp1pp4"}
    assert selection.rejected == {"tp2pp2": "not in the profile: calibrate it"}
    none = select(layouts=["tp2pp2"])
    assert none.allowed == () and none.chosen is None and "no layout of the intent is in the profile" in none.note


def test_outside_every_window_the_default_has_no_targets():
    intents = parse_intents({"windows": [{"name": "night", "start": "00:00", "end": "06:00", "tpot_ms": 1}]})
    selection = select_layouts(intents, PROFILE, at(2, 12), LOAD_10, "tp4pp1")
    assert (selection.window, selection.priority, selection.allowed[0]) == ("default", "latency", "tp4pp1")
    assert selection.is_met and select_layouts(intents, PROFILE, at(2, 1), LOAD_10, "tp4pp1").window == "night"


def test_when_none_passes_the_one_that_misses_least_is_the_fallback():
    fast = select({"tpot_ms": 5})  # every layout misses TPOT only: the latency order decides
    assert fast.allowed == ("tp4pp1",) and not fast.is_met
    assert "no layout meets the intent of window 'w'; tp4pp1 misses least (TPOT 15.0 ms > target 5 ms)" in fast.note
    crowded = select({"tpot_ms": 5}, demand=Demand(80, 160, 1000))  # only tp1pp4 holds the load
    assert crowded.allowed == ("tp1pp4",) and crowded.note
    flood = select({"tpot_ms": 5}, demand=Demand(500, 160, 1000))   # none holds it: the one holding the most
    assert flood.allowed == ("tp1pp4",)
    # the budget before the targets: tp4pp1 misses only the switch budget, the live tp1pp2 only TPOT: it stays
    budget = select({"tpot_ms": 20}, demand=Demand(10, 160, 1000), reconfiguration_budget_ms=0, live="tp1pp2")
    assert budget.allowed == ("tp1pp2",) and "tp1pp2 misses least" in budget.note
    table = format_selection(fast)
    assert "fallback: TPOT 15.0 ms > target 5 ms" in table and table.splitlines()[-1].startswith("note: no layout")
    assert set(fast.within_budget) == set(PROFILE.layouts) and budget.within_budget == ("tp1pp2",)


def test_when_none_passes_the_autopilot_keeps_its_own_rules_among_the_layouts_within_the_budget():
    """The loop hands the policy the fallback alone only for "cost"; otherwise every layout a switch may take
    (a forced move to the layout that misses least by a few per cent gained nothing in bench/autopilot.py)."""
    def allowed(window: dict, **top) -> tuple:
        pilot = Autopilot(None, AutopilotConfig(), PROFILE,
                          parse_intents({"windows": [{"name": "w", "start": "00:00", "end": "24:00"} | window]} | top))
        obs = Observation(t=0.0, running=10, waiting=0, kv_used_blocks=0, context=160, prompt_tokens=1000)
        bounds = pilot.intent_bounds(obs, "tp1pp2")
        return bounds.allowed, bounds.rejected, bounds.tpot_target_s

    names = tuple(PROFILE.layouts)
    assert allowed({"tpot_ms": 5}) == (names, {n: select({"tpot_ms": 5}, live="tp1pp2").rejected[n] for n in names},
                                       0.005)
    assert allowed({"tpot_ms": 5}, reconfiguration_budget_ms=0)[0] == ("tp1pp2",)
    assert allowed({"tpot_ms": 5, "priority": "cost"})[0] == select({"tpot_ms": 5, "priority": "cost"},
                                                                     live="tp1pp2").allowed
    assert allowed({"tpot_ms": 1000})[0] == select({"tpot_ms": 1000}, live="tp1pp2").allowed  # met: as selected


def test_format_selection_lists_every_candidate():
    table = format_selection(select({"tpot_ms": 20}, layouts=["tp4pp1", "tp1pp4", "tp2pp2"]))
    lines = table.splitlines()
    assert lines[0] == "window w (priority latency): tp4pp1"
    assert lines[2].startswith("tp4pp1") and lines[2].endswith("allowed #1")
    assert "rejected: TPOT 32.0 ms > target 20 ms" in lines[3]
    assert lines[4].startswith("tp2pp2") and lines[4].endswith("rejected: not in the profile: calibrate it")


NAMES = ("tp4pp1", "tp1pp4", "tp2pp2", "tp1pp2")


@st.composite
def profiles(draw: st.DrawFn) -> Profile:
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
    models = {n: LayoutModel(n, draw(st.floats(1e-3, 0.05)), draw(st.floats(1e-5, 2e-3)), draw(st.floats(0, 1e-6)),
                             draw(st.floats(0, 0.05)), draw(st.floats(0, 1e-3)), draw(st.integers(0, 3000)), 16,
                             draw(st.integers(1, 8))) for n in names}
    switches = {(a, b): SwitchSample(a, b, draw(st.floats(0.0, 2.0))) for a in names for b in names
                if a != b and draw(st.booleans())}
    return Profile("llama", "test", models, switches)


@settings(max_examples=300, deadline=None)
@given(profile=profiles(), load=st.floats(0, 300), context=st.floats(1, 4000), prompt=st.floats(1, 8000),
       rate=st.floats(0, 50), tpot_ms=st.none() | st.floats(1, 100), ttft_ms=st.none() | st.floats(5, 5000),
       floor=st.none() | st.floats(0, 1), budget=st.none() | st.floats(0, 2000),
       priority=st.sampled_from(["latency", "throughput", "cost"]), live=st.sampled_from(NAMES))
def test_allowed_layouts_meet_every_stated_target(profile, load, context, prompt, rate, tpot_ms, ttft_ms, floor,
                                                  budget, priority, live):
    window = {"name": "w", "start": "00:00", "end": "24:00", "priority": priority, "tpot_ms": tpot_ms,
              "p99_ttft_ms": ttft_ms, "min_utilization": floor}
    data = {"reconfiguration_budget_ms": budget, "windows": [{k: v for k, v in window.items() if v is not None}]}
    intents = parse_intents({k: v for k, v in data.items() if v is not None})
    demand = Demand(load, context, prompt, rate)
    selection = select_layouts(intents, profile, at(3, 12), demand, live)
    assert selection.chosen == selection.allowed[0] and selection.allowed
    assert set(selection.allowed) | set(selection.rejected) == set(profile.layouts)
    holds = {n for n, m in profile.layouts.items() if m.max_requests(context) >= load}
    if holds:
        assert set(selection.allowed) <= holds
    if not selection.is_met:
        assert len(selection.allowed) == 1
        return
    assert not set(selection.allowed) & set(selection.rejected)
    for name in selection.allowed:
        model = profile.layouts[name]
        tpot = model.tpot(load, context)
        assert model.max_requests(context) >= load
        assert tpot_ms is None or tpot <= tpot_ms / 1000
        assert ttft_ms is None or (model.prefill(prompt) + tpot <= ttft_ms / 1000 and rate * model.prefill(prompt) < 1)
        assert budget is None or name == live or profile.switch_cost(live, name).downtime_s * 1000 <= budget
        capacity = model.throughput(model.max_requests(context), context)
        assert floor is None or (load / tpot) / capacity >= floor


# ---- reconfigctl intent ----------------------------------------------------------------------------------------------
def run_intent(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="reconfigctl")
    add_intent_parser(parser.add_subparsers(dest="command", required=True))
    return intent_command(parser.parse_args(["intent", *argv]))


def test_check_prints_the_intents_or_the_error(tmp_path, capsys):
    path = tmp_path / "intents.toml"
    path.write_text(EXAMPLE_TOML)
    assert run_intent("check", str(path)) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{path}: valid\nreconfiguration budget: 500 ms per switch\nlayouts: tp4pp1, tp1pp4\n")
    assert "peak_hours      mon-fri           09:00-18:00    p99 TTFT <= 2000 ms, TPOT <= 150 ms" in out
    assert "off_peak_hours  every day         18:00-09:00+1  utilization >= 40%" in out
    assert run_intent("check", str(path), "--json") == 0
    assert Intents.model_validate_json(capsys.readouterr().out) == load_intents(path)
    path.write_text(EXAMPLE_TOML.replace('start = "09:00"', 'start = "9:00"'))
    assert run_intent("check", str(path)) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "windows[0] ('peak_hours').start" in captured.err


def test_toml_of_the_intents_reads_back_the_same(tmp_path):
    intents = parse_intents(example() | {"reconfiguration_budget_ms": 12.5})
    (tmp_path / "again.toml").write_text(to_toml(intents))
    assert load_intents(tmp_path / "again.toml") == intents
    assert to_toml(Intents()) == "\n" and parse_intents(tomllib.loads(to_toml(Intents()))) == Intents()


class FakeLLM(ThreadingHTTPServer):
    """An OpenAI-compatible endpoint with a canned chat reply; it records what it was asked."""

    daemon_threads = True
    content = ""
    status = 200
    delay_s = 0.0

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.requests: list[tuple[str, dict, dict]] = []
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}/v1"

    def handle_error(self, request, client_address) -> None:
        pass  # a client that timed out has closed its end: the late answer breaks the pipe, as it should


class FakeHandler(BaseHTTPRequestHandler):
    server: FakeLLM

    def log_message(self, *args) -> None:
        pass

    def answer(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.server.requests.append((self.path, dict(self.headers), {}))
        self.answer({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, dict(self.headers), body))
        time.sleep(self.server.delay_s)  # not synchronisation: the slow endpoint a test injects
        message = {"role": "assistant", "content": self.server.content}
        self.answer({"id": "chatcmpl-1", "object": "chat.completion", "model": body["model"],
                     "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})


@pytest.fixture
def llm(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "RECONFIG_INTENT_ENDPOINT", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    server = FakeLLM()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_draft_prints_a_valid_reply_and_writes_it_only_with_o(llm, tmp_path, capsys):
    llm.content = json.dumps(EXAMPLE_INTENTS)
    assert run_intent("draft", "keep it fast by day", "--endpoint", llm.endpoint) == 0
    out = capsys.readouterr().out
    assert out.startswith("# drafted by fake-model from: keep it fast by day\n")
    assert parse_intents(tomllib.loads(out)) == parse_intents(EXAMPLE_INTENTS)
    assert list(tmp_path.iterdir()) == []
    (models, _, _), (chat, _, body) = llm.requests
    assert (models, chat, body["model"], body["temperature"]) == ("/v1/models", "/v1/chat/completions",
                                                                  "fake-model", 0)
    system, user = body["messages"]
    assert user == {"role": "user", "content": "keep it fast by day"}
    assert json.dumps(Intents.model_json_schema()) in system["content"] and "off_peak_hours" in system["content"]
    assert run_intent("draft", "same", "--endpoint", llm.endpoint, "--model", "m2", "-o", str(tmp_path / "a.toml")) == 0
    assert load_intents(tmp_path / "a.toml") == parse_intents(EXAMPLE_INTENTS)
    assert [r[0] for r in llm.requests[2:]] == ["/v1/chat/completions"] and llm.requests[2][2]["model"] == "m2"


def test_draft_finds_json_inside_fences_and_honours_the_environment(llm, tmp_path, monkeypatch, capsys):
    llm.content = "Here are the intents:\n```json\n" + json.dumps(EXAMPLE_INTENTS, indent=2) + "\n```\nAnything else?"
    monkeypatch.setenv("RECONFIG_INTENT_ENDPOINT", llm.endpoint + "/")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    assert run_intent("draft", "as usual", "-o", str(tmp_path / "a.json")) == 0
    assert "peak_hours" in capsys.readouterr().out
    assert load_intents(tmp_path / "a.json") == parse_intents(EXAMPLE_INTENTS)
    assert all(headers["Authorization"] == "Bearer sk-test" for _, headers, _ in llm.requests)
    assert first_json_object("no {json} here {\"a\": {\"b\": 1}} {\"c\": 2}") == {"a": {"b": 1}}


@pytest.mark.parametrize("content, error", [
    (json.dumps({"peak_hours": {"p99_ttft_ms": 2000, "priority": "latency"}}), "peak_hours: unknown key"),
    (json.dumps(mutated(("windows", 1, "end"), "10:00")), "overlap"),
    ("I cannot help with that.", "no JSON object in it"),
])
def test_draft_rejects_an_invalid_reply_and_writes_nothing(llm, tmp_path, capsys, content, error):
    llm.content = content
    assert run_intent("draft", "x", "--endpoint", llm.endpoint, "-o", str(tmp_path / "a.toml")) == 1
    captured = capsys.readouterr()
    assert captured.out == f"fake-model replied:\n{content}\n"
    assert "the reply does not validate, nothing written: the reply of fake-model" in captured.err and \
        error in captured.err
    assert not (tmp_path / "a.toml").exists()


def test_draft_fails_in_one_line_when_the_endpoint_does(llm, capsys):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{closed.getsockname()[1]}/v1"
    assert run_intent("draft", "x", "--endpoint", refused) == 1
    assert capsys.readouterr().err == f"reconfigctl intent draft: cannot reach {refused}/models: Connection refused\n"
    llm.delay_s = 0.5
    assert run_intent("draft", "x", "--endpoint", llm.endpoint, "--model", "m", "--timeout", "0.1") == 1
    assert capsys.readouterr().err == f"reconfigctl intent draft: no answer from {llm.endpoint}/chat/completions " \
                                      "within 0.1 s\n"
    llm.delay_s, llm.status = 0.0, 500
    assert run_intent("draft", "x", "--endpoint", llm.endpoint) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"reconfigctl intent draft: {llm.endpoint}/models answered HTTP 500: ") and \
        err.count("\n") == 1
    assert run_intent("draft", "x", "-o", "intents.yaml") == 2
