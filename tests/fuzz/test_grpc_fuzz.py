"""Fuzz the gRPC services with hypothesis: the Router (Generate, and the admin RPCs with and without the token), the
Controller (GetStatus, WatchStatus, Reconfigure, Plan, AddWorker) and the Worker's PrepareSwitch, all real servers on port 0
over two real workers, plus undecodable bytes sent to every method. Every call ends OK or with a precise status
(never INTERNAL or UNKNOWN) and a message; afterwards the stack serves: Generate equals the oracle, GetStatus is
SERVING in the layout it started in. Then the regression tests of what the fuzzers found."""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Callable

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.api.limits import INLINE_ENCODE_CHARS
from services.router.grpc_server import ADMIN_METHODS
from services.rpc.auth import auth_metadata
from services.rpc.reconfig.v1 import controller_pb2, router_pb2, worker_pb2
from services.topology import Topology
from tests.conftest import until
from tests.fuzz.conftest import (
    FUZZ_SETTINGS,
    ORACLE_MAX_TOKENS,
    ORACLE_PROMPT,
    TOKEN,
    TOPOLOGY,
    GrpcStack,
    admin,
    generate_all,
    outcome,
    raw_call,
)

pytestmark = pytest.mark.multiprocess

VALID_TARGETS = ("tp1pp1", "tp2pp1", "tp1pp2")  # the layouts 2 workers can run this model in
MIN_CASES = 1000
Code = grpc.StatusCode
NEVER = {Code.INTERNAL, Code.UNKNOWN}
CASES: collections.Counter[str] = collections.Counter()   # calls per fuzzer (the health test checks the total)
CODES: collections.Counter[str] = collections.Counter()   # status codes seen

int32 = st.integers(-(1 << 31), (1 << 31) - 1)
float32 = st.floats(width=32)             # NaN, infinities and subnormals included
float64 = st.floats()
short_text = st.text(max_size=12)


def check(label: str, error: grpc.aio.AioRpcError | None, allowed: set[Code], context: object) -> None:
    """Count the call; an error must be one of `allowed` (never INTERNAL/UNKNOWN) and say what is wrong."""
    CASES[label] += 1
    CODES[error.code().name if error else "OK"] += 1
    if error is None:
        return
    assert error.code() not in NEVER, (label, error.code(), error.details(), context)
    assert error.code() in allowed, (label, error.code(), error.details(), context)
    assert error.details(), (label, error.code(), context)


async def restore_router(stack: GrpcStack) -> None:
    """Undo whatever admin calls did: the start capacity, not frozen."""
    stats = await stack.router.Stats(router_pb2.StatsRequest(), **admin())
    if stats.num_kv_blocks_total != stack.capacity:
        await stack.router.Freeze(router_pb2.FreezeRequest(), **admin())
        await stack.router.Rebind(router_pb2.RebindRequest(num_kv_blocks=stack.capacity), **admin())
    await stack.router.Resume(router_pb2.ResumeRequest(), **admin())


# ---- Router.Generate ---------------------------------------------------------------------------------------------
sampling = st.builds(worker_pb2.SamplingParams, temperature=st.one_of(st.floats(0, 2, width=32), float32),
                     top_p=st.one_of(st.floats(0, 1, width=32), float32), top_k=st.one_of(st.integers(0, 300), int32),
                     seed=st.one_of(st.none(), st.integers(0, (1 << 64) - 1)))
generate_requests = st.builds(
    router_pb2.GenerateRequest,
    request_id=st.one_of(st.sampled_from(["", "a", "b"]), short_text),   # repeats collide while running
    prompt_token_ids=st.one_of(st.lists(st.integers(0, 263), max_size=36), st.lists(int32, max_size=4)),
    prompt=st.one_of(st.just(""), st.text(max_size=40), st.just("x" * 20_000)),  # the long one: off the loop
    sampling=st.one_of(st.none(), sampling),
    max_tokens=st.one_of(st.integers(-2, 34), int32),
    stop=st.lists(st.text(max_size=4), max_size=3),
    stop_token_ids=st.lists(int32, max_size=3),
    ignore_eos=st.booleans(),
)


def test_generate_ends_ok_or_with_a_precise_status(grpc_stack):
    """Random (and concurrent, id-colliding, cancelled) Generate calls: each stream ends "stop"/"length" within
    max_tokens, or fails before its first response with INVALID_ARGUMENT / RESOURCE_EXHAUSTED and a message."""

    @settings(FUZZ_SETTINGS, max_examples=300)
    @given(batch=st.lists(st.tuples(generate_requests, st.integers(-1, 2)), min_size=1, max_size=3))
    def fuzz(batch) -> None:
        requests = [request for request, _ in batch]
        results = grpc_stack.run(generate_all(grpc_stack, requests, [cancel for _, cancel in batch]))
        for request, (responses, error) in zip(requests, results, strict=True):
            if error == "cancelled":
                CASES["Router.Generate"] += 1
                continue
            check("Router.Generate", error, {Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED}, request)
            if error is not None:
                assert not responses, (request, responses, error.details())
                continue
            assert responses and responses[-1].finish_reason in ("stop", "length"), (request, responses[-1:])
            assert not any(r.finish_reason for r in responses[:-1]) and not responses[-1].error
            assert sum(len(r.token_ids) for r in responses) <= request.max_tokens
            assert len({r.request_id for r in responses}) == 1

    fuzz()


# ---- Router admin RPCs -------------------------------------------------------------------------------------------
# Malformed worker addresses only: a well-formed address nobody serves breaks the router (Engine.rebind closes
# its driver before the new one connects; reported, not fuzzed).
bad_addresses = st.one_of(
    st.sampled_from(["", ":", "host:", ":80", "h:0", "h:65536", "h :1", "h:-1", "h:1a", "h:99999999999"]),
    st.text(st.characters(exclude_characters=":"), max_size=10),
)
admin_requests = st.one_of(
    st.builds(lambda t: ("Freeze", router_pb2.FreezeRequest(timeout_seconds=t)), float64),
    st.builds(lambda n, a: ("Rebind", router_pb2.RebindRequest(num_kv_blocks=n, worker_addresses=a)),
              st.one_of(st.integers(-2, 300), int32), st.one_of(st.just([]), st.lists(bad_addresses, max_size=2))),
    st.just(("Resume", router_pb2.ResumeRequest())),
    st.just(("Stats", router_pb2.StatsRequest())),
)
# Printable ASCII only: gRPC metadata values are; anything but "Bearer <token>" must be refused.
header_value = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
bad_metadata = st.one_of(
    st.just(()),
    st.builds(lambda v: (("authorization", v),), header_value),
    st.builds(lambda v: (("authorization", "Bearer " + v),), header_value.filter(lambda v: v != TOKEN)),
    st.just((("authorization", "bearer " + TOKEN),)),
    st.just((("authorization", "Bearer " + TOKEN + " "),)),
    st.just((("x-authorization", "Bearer " + TOKEN),)),
)


def _router_method(stack: GrpcStack, name: str) -> Callable:
    return getattr(stack.router, name)


def test_admin_rpcs_without_the_token_are_unauthenticated(grpc_stack):
    """Freeze/Rebind/Resume/Stats with no, a wrong or a mangled token: UNAUTHENTICATED, nothing changes."""

    @settings(FUZZ_SETTINGS, max_examples=150)
    @given(call=admin_requests, metadata=bad_metadata)
    def fuzz(call, metadata) -> None:
        name, request = call
        _, error = grpc_stack.run(outcome(lambda: _router_method(grpc_stack, name)(request, metadata=metadata,
                                                                                      timeout=10)))
        check(f"Router.{name} (no token)", error, {Code.UNAUTHENTICATED}, (request, metadata))
        assert error is not None and error.code() == Code.UNAUTHENTICATED

    fuzz()
    stats = grpc_stack.engine.stats()
    assert not stats.is_frozen and stats.num_kv_blocks_total == grpc_stack.capacity


def test_admin_rpcs_with_the_token_keep_the_router_consistent(grpc_stack):
    """Sequences of admin calls with the token: each ends OK or with a precise status (Rebind while not frozen
    is FAILED_PRECONDITION, a capacity out of range INVALID_ARGUMENT); restoring works after each."""

    @settings(FUZZ_SETTINGS, max_examples=100)
    @given(calls=st.lists(admin_requests, min_size=1, max_size=4))
    def fuzz(calls) -> None:
        async def run() -> list:
            results = [await outcome(_router_method(grpc_stack, name)(request, **admin())) for name, request in calls]
            await restore_router(grpc_stack)
            return results

        for (name, request), (_, error) in zip(calls, grpc_stack.run(run()), strict=True):
            allowed = {Code.FAILED_PRECONDITION, Code.INVALID_ARGUMENT} if name == "Rebind" else set()
            check(f"Router.{name}", error, allowed, request)

    fuzz()
    stats = grpc_stack.engine.stats()
    assert not stats.is_frozen and stats.num_kv_blocks_total == grpc_stack.capacity


# ---- Controller ----------------------------------------------------------------------------------------------------
topologies = st.one_of(
    st.sampled_from([*VALID_TARGETS, "tp2pp2", "tp4", "pp4", "tp3pp1", "tp0pp1", "tp1pp0", "TP2PP1", " tp1pp2 ",
                     "tp1pp1tp1", "pp2tp1", "ep2", "tp-1", "tp1.5", "tp" + "9" * 30, "tp" + "9" * 5000, ""]),
    st.text(max_size=10),
    st.builds("tp{}pp{}".format, int32, int32),
)
partitions = st.one_of(st.just([]), st.lists(st.integers(-1, 4), max_size=3), st.lists(int32, max_size=2))
deadlines = st.one_of(st.just(0.0), st.floats(0.001, 60), float64)
operation_ids = st.one_of(st.sampled_from(["", "op-a", "op-b"]), short_text)


def _no_real_switch(request: controller_pb2.ReconfigureRequest) -> controller_pb2.ReconfigureRequest:
    """Keep the fuzzer fast: a request that would really switch becomes a dry run (test_a_few_real_switches
    switches for real)."""
    try:
        is_valid = str(Topology.parse(request.topology)) in VALID_TARGETS
    except ValueError:  # TopologyError, or too many digits for an int
        is_valid = False
    request.dry_run = request.dry_run or is_valid
    return request


reconfigure_requests = st.builds(
    controller_pb2.ReconfigureRequest, topology=topologies, operation_id=operation_ids, deadline_seconds=deadlines,
    strategy=st.one_of(st.sampled_from(["", "in-place", "shadow"]), short_text), dry_run=st.booleans(),
    layer_partition=partitions,
).map(_no_real_switch)
controller_calls = st.one_of(
    st.builds(lambda r: ("Reconfigure", r), reconfigure_requests),
    st.builds(lambda t, p: ("Plan", controller_pb2.PlanRequest(topology=t, layer_partition=p)), topologies,
              partitions),
    st.just(("GetStatus", controller_pb2.GetStatusRequest())),
    st.builds(lambda i: ("WatchStatus", controller_pb2.WatchStatusRequest(interval_seconds=i)), float64),
    # Nothing here is a joining worker: a closed port, no port, a bad one, text; always refused, nothing changes.
    st.builds(lambda a, t, o: ("AddWorker", controller_pb2.AddWorkerRequest(address=a, topology=t, operation_id=o)),
              st.one_of(short_text, st.sampled_from(["127.0.0.1:1", "127.0.0.1:0", "127.0.0.1", ":80",
                                                     "127.0.0.1:99999", "[::1]:1"])), topologies, operation_ids),
)


async def controller_call(stack: GrpcStack, name: str, request, metadata) -> tuple[object, object]:
    if name == "WatchStatus":  # the first status, then hang up
        call = stack.controller.WatchStatus(request, metadata=metadata, timeout=10)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as error:
            return None, error
        call.cancel()
        return first, None
    return await outcome(getattr(stack.controller, name)(request, metadata=metadata, timeout=30))


def test_controller_rpcs_end_ok_or_with_a_precise_status(grpc_stack):
    """Random Reconfigure (invalid, no-op, dry run, repeated ids, odd deadlines), Plan, GetStatus and WatchStatus
    with the token: OK, or INVALID_ARGUMENT / FAILED_PRECONDITION with a message; the live layout never moves."""

    @settings(FUZZ_SETTINGS, max_examples=250)
    @given(call=controller_calls)
    def fuzz(call) -> None:
        name, request = call
        response, error = grpc_stack.run(controller_call(grpc_stack, name, request, auth_metadata(TOKEN)))
        check(f"Controller.{name}", error, {Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION}, request)
        if name == "Reconfigure" and error is None:
            assert response.state in (controller_pb2.OPERATION_STATE_SUCCEEDED,), response
        assert str(grpc_stack.state.topology) == TOPOLOGY

    fuzz()


def test_controller_rpcs_without_the_token_are_unauthenticated(grpc_stack):
    """Every Controller RPC needs the token."""

    @settings(FUZZ_SETTINGS, max_examples=100)
    @given(call=controller_calls, metadata=bad_metadata)
    def fuzz(call, metadata) -> None:
        name, request = call
        _, error = grpc_stack.run(controller_call(grpc_stack, name, request, metadata))
        check(f"Controller.{name} (no token)", error, {Code.UNAUTHENTICATED}, (request, metadata))
        assert error is not None and error.code() == Code.UNAUTHENTICATED

    fuzz()


# ---- Worker.PrepareSwitch ------------------------------------------------------------------------------------------
def test_worker_prepare_switch_ends_ok_or_invalid_argument(grpc_stack):
    """Random targets and partitions, with and without the token: OK (nothing changes), INVALID_ARGUMENT with a
    message, or UNAUTHENTICATED without the token."""

    @settings(FUZZ_SETTINGS, max_examples=150)
    @given(topology=topologies, partition=partitions, rank=st.integers(0, 1), has_token=st.booleans())
    def fuzz(topology, partition, rank, has_token) -> None:
        request = worker_pb2.PrepareSwitchRequest(topology=topology, layer_partition=partition)
        metadata = auth_metadata(TOKEN) if has_token else ()
        _, error = grpc_stack.run(outcome(lambda: grpc_stack.workers[rank].PrepareSwitch(request, metadata=metadata,
                                                                                 timeout=10)))
        allowed = {Code.INVALID_ARGUMENT} if has_token else {Code.UNAUTHENTICATED}
        check("Worker.PrepareSwitch", error, allowed, request)
        if not has_token:
            assert error is not None

    fuzz()


# ---- undecodable bytes ---------------------------------------------------------------------------------------------
# (channel, full method name, response streams?) — methods that may run on any parsed request with the token; the
# mutating admin and worker RPCs get raw bytes only without it.
RAW_WITH_TOKEN = [
    ("router", "/reconfig.v1.Router/Generate", True), ("router", "/reconfig.v1.Router/Stats", False),
    ("controller", "/reconfig.v1.Controller/GetStatus", False), ("controller", "/reconfig.v1.Controller/Plan", False),
    ("worker0", "/reconfig.v1.Worker/PrepareSwitch", False), ("worker1", "/reconfig.v1.Worker/GetInfo", False),
]
RAW_WITHOUT_TOKEN = [
    *[("router", method, False) for method in ADMIN_METHODS],
    ("controller", "/reconfig.v1.Controller/Reconfigure", False),
    ("controller", "/reconfig.v1.Controller/WatchStatus", True),
    ("controller", "/reconfig.v1.Controller/AddWorker", False),
    ("worker0", "/reconfig.v1.Worker/ApplySwitch", False), ("worker1", "/reconfig.v1.Worker/Shutdown", False),
    ("worker0", "/reconfig.v1.Worker/Regroup", False),
]
raw_payloads = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"\xff\xff\xff", b"\x0a\x02\xc3\x28", b"\x1a\x03\xed\xa0\x80", b"\x08" + b"\xff" * 11,
                     b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05\x08\x01"]),
)


def test_undecodable_requests_are_invalid_argument(grpc_stack):
    """Bytes that are no protobuf of the method's request type (corrupt wire format, bad UTF-8 in a string):
    INVALID_ARGUMENT, or UNAUTHENTICATED without the token; bytes that happen to parse are served normally."""

    @settings(FUZZ_SETTINGS, max_examples=150)
    @given(target=st.sampled_from([(t, True) for t in RAW_WITH_TOKEN] + [(t, False) for t in RAW_WITHOUT_TOKEN]),
           payload=raw_payloads)
    def fuzz(target, payload) -> None:
        (channel, method, is_stream), has_token = target
        metadata = auth_metadata(TOKEN) if has_token else ()
        _, error = grpc_stack.run(raw_call(grpc_stack, channel, method, is_stream, payload, metadata))
        allowed = ({Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED} if has_token else {Code.UNAUTHENTICATED})
        check(f"raw {method}", error, allowed, payload)
        if not has_token:
            assert error is not None

    fuzz()


# ---- a few real switches, then health --------------------------------------------------------------------------------
def test_a_few_real_switches_with_odd_arguments(grpc_stack):
    """Real Reconfigure calls: valid targets switch (odd but valid deadlines and partitions), invalid deadlines
    are INVALID_ARGUMENT, a second switch while one runs is FAILED_PRECONDITION, and the layout comes back."""
    controller, meta = grpc_stack.controller, auth_metadata(TOKEN)

    def reconfigure(**fields):
        request = controller_pb2.ReconfigureRequest(**fields)
        response, error = grpc_stack.run(outcome(lambda: controller.Reconfigure(request, metadata=meta, timeout=60)))
        check("Controller.Reconfigure (real)", error, {Code.INVALID_ARGUMENT}, request)
        return response, error

    for deadline in (math.nan, -1.0, -math.inf, math.inf):
        _, error = reconfigure(topology="tp1pp2", deadline_seconds=deadline)
        assert error is not None and error.code() == Code.INVALID_ARGUMENT and "deadline" in error.details()
    assert str(grpc_stack.state.topology) == TOPOLOGY

    async def concurrent() -> list:
        first = controller.Reconfigure(controller_pb2.ReconfigureRequest(topology="tp1pp2", layer_partition=[1, 2],
                                                                          operation_id="real-1"), metadata=meta)

        def first_started() -> bool:
            operation = grpc_stack.state.status.last_operation
            return operation is not None and operation.operation_id == "real-1"

        await until(first_started, what="the controller to start switch real-1")  # the second overlaps it (or follows)
        second = controller.Reconfigure(controller_pb2.ReconfigureRequest(topology="tp1pp1"), metadata=meta)
        return [await outcome(first), await outcome(second)]

    (first, first_error), (second, second_error) = grpc_stack.run(concurrent())
    check("Controller.Reconfigure (real)", first_error, set(), "real-1")
    check("Controller.Reconfigure (real)", second_error, {Code.FAILED_PRECONDITION}, "concurrent")
    assert first.state == controller_pb2.OPERATION_STATE_SUCCEEDED and first.to_topology == "tp1pp2", first
    if second_error is None:  # the first had already ended: the second switched after it
        assert second.to_topology == "tp1pp1" and str(grpc_stack.state.topology) == "tp1pp1"
    else:
        assert "real-1" in second_error.details()
        assert (str(grpc_stack.state.topology), grpc_stack.state.layer_partition) == ("tp1pp2", (1, 2))
    for fields, live in ((dict(topology="tp1pp1", deadline_seconds=1e9), "tp1pp1"),
                         (dict(topology=" TP2PP1 ", deadline_seconds=30), TOPOLOGY),
                         (dict(topology="tp1pp2", operation_id="real-1"), TOPOLOGY)):  # a retry: no switch
        response, error = reconfigure(**fields)
        assert error is None and response.state == controller_pb2.OPERATION_STATE_SUCCEEDED, (fields, response)
        assert str(grpc_stack.state.topology) == live


def test_stack_serves_after_fuzzing(grpc_stack, oracle_tokens):
    """After the fuzzers: >= MIN_CASES calls, none INTERNAL/UNKNOWN; Generate equals the oracle; GetStatus is
    SERVING in the start layout; the router is idle, unfrozen, at its start capacity."""
    if not CASES:
        pytest.skip("the fuzzers did not run in this session (deselected)")
    total = sum(CASES.values())
    print(f"\ngRPC fuzz: {total} calls {dict(CASES)}; codes {dict(CODES)}")
    assert total >= MIN_CASES, dict(CASES)
    assert not {"INTERNAL", "UNKNOWN"} & set(CODES), dict(CODES)
    request = router_pb2.GenerateRequest(prompt_token_ids=ORACLE_PROMPT, max_tokens=ORACLE_MAX_TOKENS,
                                         ignore_eos=True)

    async def generate_and_status():
        tokens = [t async for response in grpc_stack.router.Generate(request, timeout=30) for t in response.token_ids]
        status = await grpc_stack.controller.GetStatus(controller_pb2.GetStatusRequest(), **admin())
        return tokens, status

    tokens, status = grpc_stack.run(generate_and_status())
    assert tokens == oracle_tokens
    assert status.state == controller_pb2.STACK_STATE_SERVING, status.reason
    assert status.topology == TOPOLOGY
    stats = grpc_stack.engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)
    assert not stats.is_frozen and stats.num_kv_blocks_total == grpc_stack.capacity
    assert stats.extra["num_step_errors"] == 0


# ---- regressions: what the fuzzers found ---------------------------------------------------------------------------
@pytest.mark.parametrize("channel, method, payload", [
    ("router", "/reconfig.v1.Router/Stats", b"\xff\xff\xff"),                     # corrupt wire format
    ("router", "/reconfig.v1.Router/Generate", b"\x1a\x02\xc3\x28"),             # prompt: bad UTF-8
    ("controller", "/reconfig.v1.Controller/Plan", b"\x0a\x02\xc3\x28"),         # topology: bad UTF-8
    ("worker0", "/reconfig.v1.Worker/PrepareSwitch", b"\x0a\x02\xc3\x28"),
])
def test_undecodable_bytes_are_invalid_argument_not_unknown(grpc_stack, channel, method, payload):
    """Request bytes that do not parse end INVALID_ARGUMENT with what is wrong (gRPC's default was UNKNOWN)."""
    is_stream = method.endswith("/Generate")
    _, error = grpc_stack.run(raw_call(grpc_stack, channel, method, is_stream, payload, auth_metadata(TOKEN)))
    assert error is not None and error.code() == Code.INVALID_ARGUMENT, error
    assert "malformed request message" in error.details()


def test_rebind_refuses_capacities_out_of_range_and_malformed_addresses(grpc_stack):
    """INVALID_ARGUMENT, and the router keeps its capacity (num_kv_blocks=2**31-1 had the block manager list two
    billion free ids; an address without a port closed the router's step streams and answered INTERNAL)."""
    router = grpc_stack.router
    one_info = [worker_pb2.WorkerInfo()]
    cases = [(2**31 - 1, [], [], "blocks"), (0, [], [], "blocks"), (-1, [], [], "blocks"),
             (grpc_stack.capacity, ["worker-without-port"], [], "host:port"),
             (grpc_stack.capacity, ["127.0.0.1:70000"], [], "host:port"),
             (grpc_stack.capacity, [], one_info, "1 worker infos for 0 worker addresses")]

    async def run() -> list:
        await router.Freeze(router_pb2.FreezeRequest(timeout_seconds=10), **admin())
        try:
            outcomes = [await outcome(router.Rebind(router_pb2.RebindRequest(num_kv_blocks=n, worker_addresses=a,
                                                                             worker_infos=infos, resume=True),
                                                    **admin())) for n, a, infos, _ in cases]
            return outcomes, grpc_stack.engine.stats().is_frozen
        finally:
            await router.Resume(router_pb2.ResumeRequest(), **admin())

    outcomes, still_frozen = grpc_stack.run(run())
    assert still_frozen  # a refused Rebind does not resume, even when asked to (the caller resumes)
    for (num_kv_blocks, addresses, _, message), (_, error) in zip(cases, outcomes, strict=True):
        assert error is not None and error.code() == Code.INVALID_ARGUMENT, (num_kv_blocks, addresses, error)
        assert message in error.details()
    stats = grpc_stack.engine.stats()
    assert stats.num_kv_blocks_total == grpc_stack.capacity and not stats.is_frozen


def test_tiny_temperatures_are_greedy_and_non_finite_ones_refused(grpc_stack, oracle_tokens):
    """temperature=1e-40 samples greedily (it divided the logits to inf: NaN probabilities failed the step of
    every request batched with it); NaN, inf and negative temperatures are INVALID_ARGUMENT."""
    def request(temperature: float | None) -> router_pb2.GenerateRequest:
        sampling = worker_pb2.SamplingParams(temperature=temperature) if temperature is not None else None
        return router_pb2.GenerateRequest(prompt_token_ids=ORACLE_PROMPT, max_tokens=ORACLE_MAX_TOKENS,
                                          ignore_eos=True, sampling=sampling)

    errors_before = grpc_stack.engine.stats().extra["num_step_errors"]
    results = grpc_stack.run(generate_all(grpc_stack, [request(1e-40), request(None)], [-1, -1]))
    for responses, error in results:
        assert error is None, error
        assert [t for r in responses for t in r.token_ids] == oracle_tokens
    for temperature in (math.nan, math.inf, -1.0):
        [(responses, error)] = grpc_stack.run(generate_all(grpc_stack, [request(temperature)], [-1]))
        assert error is not None and error.code() == Code.INVALID_ARGUMENT and "temperature" in error.details()
    assert grpc_stack.engine.stats().extra["num_step_errors"] == errors_before


def test_long_text_prompts_are_tokenized_off_the_event_loop(grpc_stack):
    """A long Generate prompt is tokenized on another thread (a 4 MB message stalled every stream for seconds);
    a short one on the loop."""
    tokenizer, threads = grpc_stack.engine.tokenizer, {}
    encode = tokenizer.encode

    def recording_encode(text: str, add_bos: bool = True) -> list[int]:
        threads[len(text)] = threading.get_ident()
        return encode(text, add_bos)

    requests_ = [router_pb2.GenerateRequest(prompt="y" * n, max_tokens=1) for n in (INLINE_ENCODE_CHARS + 1, 3)]
    tokenizer.encode = recording_encode
    try:
        results = [grpc_stack.run(generate_all(grpc_stack, [request], [-1]))[0] for request in requests_]
    finally:
        del tokenizer.encode
    (_, too_long), (responses, ok) = results
    assert too_long is not None and too_long.code() == Code.INVALID_ARGUMENT and ok is None and responses
    assert threads[INLINE_ENCODE_CHARS + 1] != grpc_stack.loop.thread.ident == threads[3]
