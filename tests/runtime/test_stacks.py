"""The registry of running stacks: a claim holds a name and ports; a second claim on either is refused before
anything starts; a stack's files go with its claim; reconfigctl picks a stack by name or port."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys

import pytest

from services.runtime.stackfile import StackFile, StackNotFoundError
from services.runtime.stacks import StackClaim, StackConflict, check_name, list_stacks, select_stack, stacks_dir

HOST = "127.0.0.1"


@pytest.fixture(autouse=True)
def run_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("RECONFIG_RUN_DIR", str(tmp_path / "run"))
    return tmp_path / "run"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def _publish(claim: StackClaim, http_port: int) -> StackFile:
    stack = StackFile(controller_address=f"{HOST}:{_free_port()}", router_http_address=f"http://{HOST}:{http_port}",
                      router_grpc_address=f"{HOST}:{_free_port()}", token_file=str(claim.token_file),
                      pids={"launcher": claim.claim.pid}, name=claim.claim.name)
    stack.write(claim.stack_file)
    return stack


def test_a_claim_owns_a_directory_and_releases_it_whole():
    http = _free_port()
    with StackClaim.take("8000", HOST, {"http": http, "grpc": 0}) as claim:
        assert claim.directory == stacks_dir() / "8000" and stat.S_IMODE(claim.directory.stat().st_mode) == 0o700
        assert json.loads((claim.directory / "lock").read_text())["ports"] == {"http": http}  # 0: nothing claimed
        claim.token_file.write_text("token\n")
        claim.state_file().write_text("{}")
        [running] = list_stacks()
        assert running.name == "8000" and running.stack is None  # starting: no stack file yet
        _publish(claim, http)
        assert list_stacks()[0].stack is not None
    assert not claim.directory.exists() and list_stacks() == []


def test_a_second_claim_on_the_same_ports_or_name_is_refused_and_touches_nothing():
    http, controller = _free_port(), _free_port()
    with StackClaim.take("first", HOST, {"http": http, "controller": controller}) as first:
        _publish(first, http)
        before = sorted(p.name for p in first.directory.iterdir())
        with pytest.raises(StackConflict) as same_port:
            StackClaim.take("second", HOST, {"http": _free_port(), "controller": controller})
        assert str(same_port.value).startswith(f"a stack is running: launcher pid {first.claim.pid}, http :{http} "
                                               f"(stack 'first', holding port {controller}) — stop it or choose "
                                               "other ports")
        with pytest.raises(StackConflict, match="holding the name 'first'"):
            StackClaim.take("first", HOST, {"http": _free_port()})
        assert sorted(p.name for p in first.directory.iterdir()) == before
        assert not (stacks_dir() / "second").exists()
        with StackClaim.take("second", HOST, {"http": _free_port()}):  # other ports, another name: both run
            assert [s.name for s in list_stacks()] == ["first", "second"]
        assert [s.name for s in list_stacks()] == ["first"]


def test_a_port_another_program_holds_is_named():
    with socket.socket() as holder:
        holder.bind((HOST, 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(StackConflict) as refused:
            StackClaim.take("x", HOST, {"http": _free_port(), "controller_metrics": port})
    assert str(refused.value) == (f"cannot listen on {HOST}:{port} (--controller-metrics-port): another program "
                                  "listens on it — choose another port")
    assert list_stacks() == []


def test_a_claim_that_fails_after_reserving_its_ports_gives_them_back_at_once(run_dir):
    """The stack's directory cannot be made (a file stands in its place): the claim fails, and the ports it had
    reserved are free again while the error (whose traceback holds the claim's frame) is still alive."""
    port = _free_port()
    stacks_dir().mkdir(parents=True, exist_ok=True)
    (stacks_dir() / "blocked").write_text("not a directory")
    with pytest.raises(FileExistsError) as failed:
        StackClaim.take("blocked", HOST, {"http": port})
    with socket.socket() as plain:  # no SO_REUSEADDR: refused while any socket is bound to the port
        plain.bind((HOST, port))
    assert failed.value is not None
    assert list_stacks() == []


def test_what_a_killed_launcher_left_is_not_running_and_is_cleaned_by_the_next_claim():
    launcher = subprocess.Popen([sys.executable, "-c", (
        "import sys; from services.runtime.stacks import StackClaim\n"
        "claim = StackClaim.take('old', '127.0.0.1', {})\n"
        "claim.token_file.write_text('token')\n"
        "print('claimed', flush=True)\n"
        "sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert launcher.stdout.readline() == "claimed\n"
    assert [s.name for s in list_stacks()] == ["old"]
    launcher.kill()  # SIGKILL: no cleanup ran; the kernel drops its lock
    launcher.wait()
    assert list_stacks() == [] and (stacks_dir() / "old" / "token").exists()
    with StackClaim.take("new", HOST, {}):
        assert not (stacks_dir() / "old").exists()


def test_select_by_name_or_port_and_the_errors_that_list_the_stacks():
    with pytest.raises(StackNotFoundError, match="no running reconfig stack found"):
        select_stack()
    http_a, http_b = _free_port(), _free_port()
    with StackClaim.take("a", HOST, {"http": http_a}) as a, StackClaim.take("b", HOST, {"http": http_b}) as b:
        _publish(a, http_a)
        stack_b = _publish(b, http_b)
        assert select_stack("a").name == "a" and select_stack(str(http_b)).name == "b"
        grpc_port = stack_b.router_grpc_address.rpartition(":")[2]
        assert select_stack(grpc_port).name == "b"  # any port of the stack
        with pytest.raises(StackNotFoundError) as several:
            select_stack()
        assert str(several.value) == (f"2 stacks are running: a (launcher pid {a.claim.pid}, http :{http_a}); "
                                      f"b (launcher pid {b.claim.pid}, http :{http_b}); choose one with --stack "
                                      "NAME|PORT (or $RECONFIG_STACK)")
        with pytest.raises(StackNotFoundError, match="no running stack is named 'c' or listens on that port; "
                                                     "running: a "):
            select_stack("c")


@pytest.mark.parametrize("name", ["", "-x", "a/b", "..", "x" * 65, "a b"])
def test_bad_names_are_refused(name):
    with pytest.raises(ValueError, match="invalid stack name"):
        check_name(name)


def test_a_claimed_port_is_kept_for_the_service_that_will_listen_on_it():
    """The claim holds its ports bound until the stack stops: the stack's own servers (gRPC, the HTTP socket)
    listen on them beside it, any other program's socket is refused, and the port is free again after."""
    import asyncio

    from services.rpc.server import listen, new_server
    from services.router.api.server import bind_http_socket

    grpc_port, http_port = _free_port(), _free_port()

    async def serve_grpc() -> int:
        server = new_server()
        bound = listen(server, HOST, grpc_port, "router")
        await server.start()
        await server.stop(None)
        return bound

    with StackClaim.take("a", HOST, {"grpc": grpc_port, "http": http_port}):
        with socket.socket() as other, pytest.raises(OSError):
            other.bind((HOST, grpc_port))
        assert asyncio.run(serve_grpc()) == grpc_port
        http = bind_http_socket(HOST, http_port)
        http.listen()
        http.close()
    with socket.socket() as other:
        other.bind((HOST, grpc_port))


_EPHEMERAL_PORTS = """
import fcntl, socket, struct, sys
from services.runtime.stacks import StackClaim
low, high, claimed = 40120, 40140, 40130
try:
    with socket.socket() as s:  # the namespace's loopback up (SIOCGIFFLAGS / SIOCSIFFLAGS, IFF_UP)
        flags = struct.unpack("16sh22x", fcntl.ioctl(s, 0x8913, struct.pack("16sh22x", b"lo", 0)))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sh22x", b"lo", flags | 1))
    with open("/proc/sys/net/ipv4/ip_local_port_range", "w") as ports:
        ports.write(f"{low} {high}")
except OSError as error:
    print(error, file=sys.stderr)
    sys.exit(77)  # this namespace cannot be set up here
server = socket.socket()
server.bind(("127.0.0.1", 20000))
server.listen(64)
with StackClaim.take("x", "127.0.0.1", {"grpc": claimed}):
    connections = []
    try:
        while True:  # until the kernel has no port left to give
            connections.append(socket.create_connection(("127.0.0.1", 20000)))
    except OSError:
        pass
    print(sorted(c.getsockname()[1] for c in connections))
"""


def test_no_outgoing_connection_is_given_a_claimed_port(run_dir):
    """The reason the claim holds its ports: the kernel hands an outgoing connection any free ephemeral port, and
    the defaults (50051-50053) lie inside Linux's ephemeral range, so one of the stack's own connections could take
    its router's port before the router listened. In a network namespace of its own with an ephemeral range of 21
    ports, connections made until none can be are never given the claimed one (they get the others, but for one
    the kernel's scan may pass over: it tries an even count of the range's ports from a random start)."""
    if subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a network namespace here (unshare -rn)")
    result = subprocess.run(["unshare", "-rn", sys.executable, "-c", _EPHEMERAL_PORTS], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "RECONFIG_RUN_DIR": str(run_dir)})
    if result.returncode == 77:
        pytest.skip(f"cannot set up the network namespace: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    ports = json.loads(result.stdout)
    assert 40130 not in ports and len(ports) >= 19 and set(ports) <= set(range(40120, 40141)), ports
