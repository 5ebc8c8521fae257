"""`reconfig up` with mutual TLS: the stack serves, `reconfigctl` reaches it with the certificate variables and is
refused without them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request

import pytest

from services.rpc.certs import write_dev_certs
from tests.conftest import process_running, wait_for_stack_file
from tests.launch.helpers import free_ports, reconfigctl, run_dir_env


@pytest.mark.multiprocess
def test_a_tls_stack_serves_and_answers_reconfigctl_with_a_certificate(tmp_path):
    node = write_dev_certs(["node-a"], tmp_path / "certs")[0]
    tls = {"RECONFIG_TLS_CERT": str(node.cert), "RECONFIG_TLS_KEY": str(node.key), "RECONFIG_TLS_CA": str(node.ca)}
    http, grpc_port, controller, metrics = free_ports(4)
    env = run_dir_env(tmp_path)
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--model", "tiny-llama", "--workers", "1", "--topology", "tp1pp1",
         "--kv-cache-mb", "2", "--api-servers", "0", "--http-port", str(http), "--grpc-port", str(grpc_port),
         "--controller-port", str(controller), "--controller-metrics-port", str(metrics),
         "--tls-cert", str(node.cert), "--tls-key", str(node.key), "--tls-ca", str(node.ca)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stack_file = wait_for_stack_file(process, tmp_path / "run")  # written once the router and controller are up
        request = urllib.request.Request(
            f"http://127.0.0.1:{http}/v1/completions", headers={"content-type": "application/json"},
            data=json.dumps({"model": "tiny-llama", "prompt": "The layout", "max_tokens": 4, "temperature": 0,
                             "ignore_eos": True}).encode())
        with urllib.request.urlopen(request, timeout=60) as response:
            completion = json.loads(response.read())
        assert completion["usage"]["completion_tokens"] == 4, completion

        status = reconfigctl({**env, **tls}, "status", "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["state"] == "SERVING"
        plaintext = reconfigctl({**env, "RECONFIG_TLS_CERT": "", "RECONFIG_TLS_KEY": "", "RECONFIG_TLS_CA": ""},
                                 "status", "--timeout", "5")
        assert plaintext.returncode == 1 and "UNAVAILABLE" in plaintext.stderr, plaintext.stderr
        pids = json.loads(stack_file.read_text())["pids"]
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
    assert code == 0, process.stderr.read()[-3000:]
    alive = [pid for name, pid in pids.items() if name != "launcher" and process_running(pid)]
    assert not alive, f"left running: {alive}"
