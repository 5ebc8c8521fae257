"""`reconfigctl intent`: check an intents file, or draft one from plain English with an LLM. Needs no controller.

`draft` asks an OpenAI-compatible endpoint (the stack's own router by default) to turn the operator's sentence into
intents: the system prompt shows the JSON schema and one example, at temperature 0. The reply is not trusted: the
first JSON object in it is validated like a file, printed in full before anything uses it, and written only with -o.
HTTP is the standard library's (urllib): `openai` and `httpx` are dev-only dependencies.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # loaded by the commands that use them: `reconfigctl --help` need not import pydantic
    from services.controller.autopilot.intents import Intents, Selection, Window

DEFAULT_ENDPOINT = "http://127.0.0.1:8000/v1"
DEFAULT_TIMEOUT_S = 60.0
EXAMPLE_REQUEST = ("Weekdays 9 to 18 keep p99 TTFT under 2 s and TPOT under 150 ms; at night keep utilization at least "
                   "40% and save cost. A switch may freeze serving for at most 500 ms. Use only tp4pp1 and tp1pp4.")
EXAMPLE_INTENTS = {
    "reconfiguration_budget_ms": 500, "layouts": ["tp4pp1", "tp1pp4"],
    "windows": [
        {"name": "peak_hours", "start": "09:00", "end": "18:00", "days": ["mon", "tue", "wed", "thu", "fri"],
         "p99_ttft_ms": 2000, "tpot_ms": 150, "priority": "latency"},
        {"name": "off_peak_hours", "start": "18:00", "end": "09:00", "min_utilization": 0.4, "priority": "cost"},
    ],
}
SYSTEM_PROMPT = """You turn an operator's service-level intent for an LLM serving stack into JSON.
Reply with exactly one JSON object that validates against this JSON schema, and nothing else:
{schema}
Rules: times are local 24-hour "HH:MM"; a window whose end is before its start wraps past midnight; windows must not
overlap; leave out every key the operator did not state; "save cost" or "efficiency" is priority "cost".
Example. Operator: "{example_request}"
JSON: {example}"""


class DraftError(Exception):
    """The endpoint could not be asked (unreachable, timed out, an HTTP error, not JSON): a one-line reason."""


def system_prompt() -> str:
    """What the model is told: the schema of `Intents` and one worked example."""
    from services.controller.autopilot.intents import Intents

    return SYSTEM_PROMPT.format(schema=json.dumps(Intents.model_json_schema()), example_request=EXAMPLE_REQUEST,
                                example=json.dumps(EXAMPLE_INTENTS))


def add_intent_parser(commands: argparse._SubParsersAction) -> None:
    """Add `intent check` and `intent draft` under `reconfigctl`."""
    intent = commands.add_parser("intent", help="SLO intents: check a file, or draft one from plain English")
    actions = intent.add_subparsers(dest="intent_command", required=True)
    check = actions.add_parser("check", help="validate an intents file (.toml or .json) and print it (exit 2 if not)")
    check.add_argument("file", type=Path, metavar="FILE")
    check.add_argument("--json", action="store_true", help="print the parsed intents as JSON")
    draft = actions.add_parser("draft", help="turn a sentence into intents with an LLM; print them, and write them "
                                             "only with -o (exit 1 if the reply does not validate)")
    draft.add_argument("text", metavar="TEXT", help="the intent in plain English, quoted")
    draft.add_argument("--endpoint", help="OpenAI-compatible base URL (default: $RECONFIG_INTENT_ENDPOINT, else "
                                          f"{DEFAULT_ENDPOINT}, the stack's router)")
    draft.add_argument("--model", help="model name (default: the first the endpoint lists in /models)")
    draft.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY)")
    draft.add_argument("-o", "--output", type=Path, metavar="FILE", help="write the validated intents (.toml/.json)")
    draft.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                       help=f"seconds to wait for each answer (default: {DEFAULT_TIMEOUT_S:g})")


def intent_command(args: argparse.Namespace) -> int:
    """Run `reconfigctl intent ...`: 0 ok; 1 the endpoint failed or its reply is invalid; 2 an invalid file."""
    return {"check": _check, "draft": _draft}[args.intent_command](args)


# ---- check -----------------------------------------------------------------------------------------------------------
def _check(args: argparse.Namespace) -> int:
    from services.controller.autopilot.intents import IntentError, load_intents

    try:
        intents = load_intents(args.file)
    except IntentError as exc:
        print(f"reconfigctl intent check: {exc}", file=sys.stderr)
        return 2
    print(intents.model_dump_json(indent=1) if args.json else f"{args.file}: valid\n{format_intents(intents)}")
    return 0


def _days(days: tuple[str, ...]) -> str:
    from services.controller.autopilot.intents import DAYS

    index = sorted(DAYS.index(day) for day in days)
    if len(index) == len(DAYS):
        return "every day"
    if len(index) > 2 and index == list(range(index[0], index[-1] + 1)):
        return f"{DAYS[index[0]]}-{DAYS[index[-1]]}"
    return ",".join(DAYS[i] for i in index)


def _targets(window: Window) -> str:
    targets = [f"p99 TTFT <= {window.p99_ttft_ms:g} ms" if window.p99_ttft_ms is not None else "",
               f"TPOT <= {window.tpot_ms:g} ms" if window.tpot_ms is not None else "",
               f"utilization >= {window.min_utilization:.0%}" if window.min_utilization is not None else ""]
    return ", ".join(filter(None, targets)) or "none"


def format_intents(intents: Intents) -> str:
    """The intents as an operator reads them: the budget, the layouts, then a row per window and the default."""
    budget = intents.reconfiguration_budget_ms
    lines = [f"reconfiguration budget: {f'{budget:g} ms per switch' if budget is not None else 'none'}",
             f"layouts: {', '.join(intents.layouts) if intents.layouts else 'every profiled one'}",
             f"{'window':<16}{'days':<18}{'time':<15}{'targets':<44}priority"]
    for window in intents.windows:
        wraps = window.end != "24:00" and window.end < window.start
        time = f"{window.start}-{window.end}{'+1' if wraps else ''}"
        lines.append(f"{window.name:<16}{_days(window.days):<18}{time:<15}{_targets(window):<44}{window.priority}")
    from services.controller.autopilot.intents import DEFAULT_WINDOW

    default = DEFAULT_WINDOW
    lines.append(f"{default.name:<16}{'other times':<18}{'-':<15}{_targets(default):<44}{default.priority}")
    return "\n".join(lines)


def format_selection(selection: Selection) -> str:
    """A table of every candidate's predictions and verdict under an intent."""
    lines = [f"window {selection.window} (priority {selection.priority}): "
             f"{selection.chosen or 'no layout'}{'' if selection.is_met else ' (fallback)'}",
             f"{'layout':<10}{'KV holds':>9}{'TPOT ms':>9}{'TTFT ms':>9}{'util':>7}{'switch ms':>11}  verdict"]
    for name, p in selection.predictions.items():
        verdict = (f"allowed #{selection.allowed.index(name) + 1}" if name in selection.allowed and selection.is_met
                   else ("fallback: " if name in selection.allowed else "rejected: ") + selection.rejected[name])
        lines.append(f"{name:<10}{p.max_requests:>9}{p.tpot_s * 1e3:>9.1f}{p.ttft_s * 1e3:>9.1f}"
                     f"{p.utilization:>7.0%}{p.switch_ms:>11.0f}  {verdict}")
    lines += [f"{name:<10}{'-':>9}{'-':>9}{'-':>9}{'-':>7}{'-':>11}  rejected: {why}"
              for name, why in selection.rejected.items() if name not in selection.predictions]
    return "\n".join(lines + ([f"note: {selection.note}"] if selection.note else []))


def _toml_value(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)  # a JSON string is a TOML basic string


def to_toml(intents: Intents) -> str:
    """The intents as an intents file (what `load_intents` reads back to the same intents)."""
    data = intents.model_dump(exclude_none=True)
    lines = [f"{key} = {_toml_value(value)}" for key, value in data.items() if key != "windows"]
    for window in data["windows"]:
        lines += ["", "[[windows]]"] + [f"{key} = {_toml_value(value)}" for key, value in window.items()]
    return "\n".join(lines).lstrip("\n") + "\n"


# ---- draft -----------------------------------------------------------------------------------------------------------
def _ask(url: str, api_key: str, timeout_s: float, body: dict | None = None) -> dict:
    """GET (or POST `body` to) an OpenAI-compatible URL and decode its JSON answer; DraftError says why not."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    request = urllib.request.Request(url, None if body is None else json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:200].decode(errors="replace").replace("\n", " ")
        raise DraftError(f"{url} answered HTTP {exc.code}: {detail}") from None
    except (OSError, http.client.HTTPException) as exc:  # URLError is an OSError
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, TimeoutError):
            raise DraftError(f"no answer from {url} within {timeout_s:g} s") from None
        raise DraftError(f"cannot reach {url}: {getattr(reason, 'strerror', None) or reason}") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise DraftError(f"{url} did not answer JSON: {raw[:120]!r}") from None


def _reply_text(endpoint: str, model: str, text: str, api_key: str, timeout_s: float) -> str:
    body = {"model": model, "temperature": 0,
            "messages": [{"role": "system", "content": system_prompt()}, {"role": "user", "content": text}]}
    answer = _ask(f"{endpoint}/chat/completions", api_key, timeout_s, body)
    try:
        return str(answer["choices"][0]["message"]["content"])
    except (KeyError, IndexError, TypeError):
        raise DraftError(f"{endpoint}/chat/completions answered no choices[0].message.content") from None


def _first_model(endpoint: str, api_key: str, timeout_s: float) -> str:
    answer = _ask(f"{endpoint}/models", api_key, timeout_s)
    try:
        return str(answer["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        raise DraftError(f"{endpoint}/models lists no model: name one with --model") from None


def first_json_object(text: str) -> object:
    """The first JSON object in a reply (bare, or inside ```json fences or prose); None when there is none."""
    decoder = json.JSONDecoder()
    for start in (i for i, char in enumerate(text) if char == "{"):
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _draft(args: argparse.Namespace) -> int:
    from services.controller.autopilot.intents import IntentError, parse_intents

    if args.output is not None and args.output.suffix not in (".toml", ".json"):
        print(f"reconfigctl intent draft: -o {args.output}: use a .toml or a .json file", file=sys.stderr)
        return 2
    endpoint = (args.endpoint or os.environ.get("RECONFIG_INTENT_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY", "")
    try:
        model = args.model or _first_model(endpoint, api_key, args.timeout)
        reply = _reply_text(endpoint, model, args.text, api_key, args.timeout)
    except DraftError as exc:
        print(f"reconfigctl intent draft: {exc}", file=sys.stderr)
        return 1
    try:
        data = first_json_object(reply)
        if data is None:
            raise IntentError(f"the reply of {model}: no JSON object in it")
        intents = parse_intents(data, f"the reply of {model}")
    except IntentError as exc:
        print(f"{model} replied:\n{reply}")
        print(f"reconfigctl intent draft: the reply does not validate, nothing written: {exc}", file=sys.stderr)
        return 1
    print(f"# drafted by {model} from: {' '.join(args.text.split())}\n{to_toml(intents)}", end="")
    if args.output is not None:
        text = intents.model_dump_json(indent=1) + "\n" if args.output.suffix == ".json" else to_toml(intents)
        args.output.write_text(text)
        print(f"reconfigctl intent draft: wrote {args.output}", file=sys.stderr)
    return 0
