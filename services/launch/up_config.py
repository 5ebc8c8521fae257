"""`reconfig up`'s settings: UpConfig (flags, a TOML file, defaults, and their checks) and the flags that set it."""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from services.contracts.numerics import DTYPES, KERNELS, MODES, check_compute
from services.contracts.phases import DEFAULT_STAGING_DUTY
from services.runtime.stacks import check_name
from services.topology import parse_gpus
from services.worker.pacing import check_duty

@dataclass(frozen=True, slots=True)
class UpConfig:
    """The stack's settings: defaults < TOML file (--config) < flags."""

    model: str = "smollm2-135m"  # a real chat model; fetched and converted on first use (`reconfig models`)
    name: str = ""               # the stack's name (reconfigctl --stack); "": its HTTP port
    workers: int = 4
    topology: str = "tp1pp4"  # 9 heads / 3 KV heads allow tp 1 or 3 only; PP4 keeps all 4 workers busy
    device: str = "cpu"
    gpus: str | int | list[int] | None = None  # --device cuda: a count or CUDA ordinals (None: every visible GPU)
    gpu_sharing: bool = False           # several workers per GPU: gloo collectives (development, one-GPU machines)
    enforce_eager: bool = False         # --device cuda: run decode steps eagerly, no CUDA graphs (debugging)
    dtype: str = "auto"                 # auto: float32 on CPU, the checkpoint's dtype on a GPU
    numerics: str = "fast"              # fast, or invariant: no token depends on the batch or the layout
    kernels: str = "torch"              # torch, or triton: fused layer kernels on CUDA (services/model/kernels.py)
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50052
    controller_port: int = 50051
    kv_cache_mb: int = 64
    block_size: int = 16
    api_key: str | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024
    spread_decodes: bool = False        # PP: the router spreads the decodes over the micro-batches in flight
    http_keep_alive_s: float = 120.0     # idle HTTP connections outlive client pools (router/api/server.py)
    shutdown_grace_s: float = 5.0       # on stop, admitted requests get this long to finish
    replace_lost_workers: bool = True   # start a joining worker for each one lost (`reconfigctl add-worker` adds it)
    async_scheduling: bool = True       # single-stage layouts: each decode's next step goes out before it returns
    api_servers: int = 1                # HTTP, tokenization and streaming in N processes apart from the engine
    num_redundant_experts: int = 0      # MoE, EP layouts: extra physical expert slots per layer (EPLB replicas)
    eplb: bool = False                  # MoE, EP layouts: the router rebalances the experts every eplb_step_interval
    eplb_window: int = 1000             # steps of per-expert load each worker keeps (EPLB's sliding window)
    eplb_step_interval: int = 3000      # steps between automatic rebalances (vLLM's defaults: 1000 / 3000)
    staging_budget_mb: int | None = None  # a switch stages only if every worker's new slices fit (None: no limit)
    staging_duty: float = DEFAULT_STAGING_DUTY  # the share of a worker's stage thread staging and the pre-copy may use
    autopilot: str = "off"              # off, advise (say what it would switch and why) or auto (switch)
    intents: str = ""                   # SLO intents file (TOML/JSON) the autopilot follows
    controller_metrics_port: int = 8001  # the controller's /metrics (the autopilot's); 0: any free port
    autopilot_policy: str = ""          # "cooldown_s=5,min_dwell_s=30,window=8,hysteresis=0.8,horizon_s=60,..."
    profile: str = ""                   # the layout profile file (default: cached per model and machine)
    instances: int = 1                  # > 1: that many instances behind one front router (MELL placement, moves)
    instance_topologies: str = ""       # each instance's layout, "tp1pp2,tp2pp1" ("": --topology for all)
    policy: str = "mell"                # the front router's placement policy: mell, bf, wf or lb
    front_grpc_port: int = 50053        # the front router's Front gRPC (reconfigctl instances)
    max_instances: int = 0              # > 0: the front starts instances up to this many, and stops idle ones
    scale_up_after_s: float = 2.0       # ... once requests waited this long for room and no instance is on standby
    standby_stop_s: float = 60.0        # ... an instance on standby this long is stopped (down to --instances)
    tls_cert: str = ""                  # all three: mutual TLS on every gRPC link and step socket of the stack
    tls_key: str = ""
    tls_ca: str = ""
    nodes: int = 1                      # hosts one instance spans (each runs --workers workers; launch/nodes.py)
    node_rank: int = 0                  # 0: the leader (router, controller, the workers' store); else a follower
    dist_addr: str = ""                 # the leader's "host:port" for the workers' store (--nodes > 1)
    token_file: str = ""                # the control-plane token, the same on every node ("": a new one)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, not {self.workers}")
        if self.name:
            check_name(self.name)
        for name in ("http_port", "grpc_port", "controller_port", "controller_metrics_port", "front_grpc_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be a port number, not {getattr(self, name)}")
        parse_gpus(self.gpus)  # a malformed --gpus fails here, with the other settings
        if self.autopilot not in ("off", "advise", "auto"):
            raise ValueError(f"autopilot must be off, advise or auto, not {self.autopilot!r}")
        from services.controller.autopilot.intents import load_intents
        from services.controller.autopilot.policy import parse_policy

        parse_policy(self.autopilot_policy)  # a bad setting or intents file fails here, before anything starts
        if self.intents:
            load_intents(self.intents)
        if self.api_servers < 0:
            raise ValueError(f"api_servers must be >= 0, not {self.api_servers}")
        if self.instances < 1:
            raise ValueError(f"instances must be >= 1, not {self.instances}")
        if self.fronted:
            from services.launch.instances import instance_topologies
            from services.placement import POLICY_NAMES

            instance_topologies(self.topology, self.instances, self.instance_topologies)
            if self.policy not in POLICY_NAMES:
                raise ValueError(f"policy must be one of {', '.join(POLICY_NAMES)}, not {self.policy!r}")
            if self.autopilot != "off":
                raise ValueError("--autopilot runs on one instance; with --instances, use each instance's "
                                 "controller (reconfigctl instances lists them)")
            self.autoscale_settings()  # a bad --max-instances fails here
        check_duty(self.staging_duty, "staging_duty")
        check_compute(self.dtype, self.numerics, self.kernels)
        self.tls  # incomplete TLS settings, or a missing file, fail here (TLSError names it)
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, not {self.num_redundant_experts}")
        self.node_layout  # a bad --nodes/--node-rank/--dist-addr fails here
        if self.nodes > 1:
            if self.fronted:
                raise ValueError("--nodes spans one instance over hosts; it does not combine with --instances")
            if not self.token_file:
                raise ValueError("--nodes needs --token-file: every node's workers require the same token")
            if self.host in ("127.0.0.1", "localhost", "0.0.0.0", "::"):
                raise ValueError(f"--nodes needs --host set to this host's address that the other nodes reach, "
                                 f"not {self.host}")
        for name in ("eplb_window", "eplb_step_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, not {getattr(self, name)}")

    @property
    def node_layout(self):
        from services.launch.nodes import NodeLayout

        return NodeLayout(self.nodes, self.node_rank, self.workers, self.dist_addr)

    @property
    def tls(self):
        """The stack's TLSConfig (None: plaintext, on loopback only once a token is involved)."""
        from services.rpc.tls import tls_config

        return tls_config(self.tls_cert, self.tls_key, self.tls_ca)

    def autoscale_settings(self):
        from services.front.autoscale import AutoscaleSettings

        return AutoscaleSettings(max_instances=self.max_instances, min_instances=self.instances,
                                 start_after_s=self.scale_up_after_s, stop_after_s=self.standby_stop_s)

    @property
    def stack_name(self) -> str:
        """--name, else the HTTP port ("8000"), else (any free port) the launcher's pid."""
        return self.name or (str(self.http_port) if self.http_port else f"pid{os.getpid()}")

    def listen_ports(self) -> dict[str, int]:
        """The ports the stack's services will listen on, by flag (0: any free port, nothing to claim)."""
        if self.fronted:  # the instances' routers and controllers take free ports
            return {"http": self.http_port, "front_grpc": self.front_grpc_port}
        return {"http": self.http_port, "grpc": self.grpc_port, "controller": self.controller_port,
                "controller_metrics": self.controller_metrics_port}

    @property
    def fronted(self) -> bool:
        """Instances behind a front router (several, or one the front may add to)."""
        return self.instances > 1 or self.max_instances > 0

    @classmethod
    def load(cls, path: Path | None, overrides: dict) -> UpConfig:
        values: dict = {}
        if path is not None:
            data = tomllib.loads(path.read_text())
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(data) - known)
            if unknown:
                raise ValueError(f"{path}: unknown setting(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
            values.update(data)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML file with any of the settings below")
    parser.add_argument("--name", help="the stack's name, for `reconfigctl --stack NAME` when several run [its HTTP "
                                       "port, e.g. 8000]")
    parser.add_argument("--model", help="preset name (`reconfig models list`) or checkpoint dir [smollm2-135m]")
    parser.add_argument("--workers", type=int, help="worker processes [4]")
    parser.add_argument("--topology", help="initial layout [tp1pp4]")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="[cpu]")
    add_gpu_arguments(parser)
    parser.add_argument("--host", help="bind address of every service [127.0.0.1]")
    parser.add_argument("--http-port", type=int, help="OpenAI API [8000]")
    parser.add_argument("--grpc-port", type=int, help="router gRPC [50052]")
    parser.add_argument("--controller-port", type=int, help="controller gRPC [50051]")
    parser.add_argument("--controller-metrics-port", type=int, help="controller /metrics (autopilot) [8001]")
    parser.add_argument("--autopilot", choices=("off", "advise", "auto"),
                        help="switch layouts by measured load: advise says what it would do (`reconfigctl autopilot "
                             "status`), auto does it; either calibrates the layouts at first start [off]")
    parser.add_argument("--intents", help="SLO intents file (TOML/JSON) the autopilot follows")
    parser.add_argument("--autopilot-policy", metavar="K=V,...",
                        help="policy settings: cooldown_s, min_dwell_s, window, hysteresis, horizon_s, kv_headroom, "
                             "min_gain, rollout [5, 30, 8, 0.8, 60, 0.1, 0.1, false]")
    parser.add_argument("--profile", help="layout profile file (`reconfigctl calibrate` writes it) [cached per "
                                          "model and machine]")
    parser.add_argument("--instances", type=int, metavar="N",
                        help="N instances (each --workers workers in its own layout, router and controller) behind "
                             "one front router that places requests and moves them live between instances [1]")
    parser.add_argument("--instance-topologies", metavar="T1,T2,...",
                        help="with --instances: each instance's layout [--topology for every one]")
    parser.add_argument("--policy", choices=("mell", "bf", "wf", "lb"),
                        help="with --instances: placement policy of the front router [mell]")
    parser.add_argument("--front-grpc-port", type=int, help="with --instances: the front router's gRPC [50053]")
    parser.add_argument("--max-instances", type=int, metavar="M",
                        help="the front router starts instances (the first one's layout) while requests wait for "
                             "room, up to M, and stops those left on standby, down to --instances [off]")
    parser.add_argument("--scale-up-after-s", type=float,
                        help="with --max-instances: start one once requests waited this long for room [2]")
    parser.add_argument("--standby-stop-s", type=float,
                        help="with --max-instances: stop an instance after this long on standby [60]")
    parser.add_argument("--kv-cache-mb", type=int, help="KV cache per worker, MiB [64]")
    parser.add_argument("--block-size", type=int, help="tokens per KV block [16]")
    parser.add_argument("--spread-decodes", action="store_true", default=None,
                        help="PP layouts: spread the running decodes over the pipeline's micro-batches, so that every "
                             "stage works on its share at once (for stages on devices of their own; "
                             "bench/pipeline.py) [off: one micro-batch of every decode]")
    parser.add_argument("--api-key", help="require this bearer key on /v1/* (default: none)")
    parser.add_argument("--api-servers", type=int, metavar="N",
                        help="processes serving the HTTP API (tokenization, detokenization, SSE), apart from the "
                             "engine's step loop; 0: the engine's process serves HTTP itself [1]")
    parser.add_argument("--http-keep-alive-s", type=float,
                        help="idle HTTP connections are kept this long; keep it above your clients' pool expiry [120]")
    parser.add_argument("--shutdown-grace-s", type=float,
                        help="on Ctrl-C/SIGTERM, requests already admitted get this long to finish [5]")
    parser.add_argument("--no-replace-lost-workers", dest="replace_lost_workers", action="store_false", default=None,
                        help="do not start a joining worker when one is lost (default: start one)")
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false", default=None,
                        help="single-stage layouts (no pipeline, no EP): the router waits for each step's tokens "
                             "before sending the next (default: it sends each decode's next step ahead; the workers "
                             "feed their own tokens)")
    add_expert_arguments(parser)
    from services.rpc.tls import add_tls_arguments

    add_tls_arguments(parser)
    add_node_arguments(parser)
    parser.add_argument("--verbose", action="store_true", help="show the services' structured logs")


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """One instance over several hosts (docs/multihost.md)."""
    parser.add_argument("--nodes", type=int, metavar="N",
                        help="hosts this instance spans, each running --workers workers and a weight store of its "
                             "own; run `reconfig up` on each with its --node-rank [1]")
    parser.add_argument("--node-rank", type=int, metavar="R",
                        help="this host's place: 0, the leader, also runs the router, the controller and the "
                             "workers' store; the others run their weight store and workers only [0]")
    parser.add_argument("--dist-addr", metavar="HOST:PORT",
                        help="with --nodes: the leader's address and a free port, where every node's workers "
                             "meet (a torch.distributed TCPStore: keep it on a trusted network)")
    parser.add_argument("--token-file", metavar="PATH",
                        help="the control-plane token (a mode-0600 file, `python -m services.rpc.auth PATH` writes "
                             "one); the same file on every node [a new token per stack]")


def add_expert_arguments(parser: argparse.ArgumentParser) -> None:
    """MoE models: redundant expert slots and EPLB (`reconfigctl eplb status|rebalance`)."""
    parser.add_argument("--num-redundant-experts", type=int, metavar="N",
                        help="MoE, EP layouts: N extra physical expert slots per layer, given to the hottest experts "
                             "by EPLB (E must divide experts + N) [0]")
    parser.add_argument("--eplb", action="store_true", default=None,
                        help="MoE, EP layouts: rebalance the experts automatically every --eplb-step-interval steps "
                             "[off; `reconfigctl eplb rebalance` runs one on demand]")
    parser.add_argument("--eplb-window", type=int, metavar="STEPS",
                        help="steps of per-expert load each worker keeps for EPLB [1000]")
    parser.add_argument("--eplb-step-interval", type=int, metavar="STEPS",
                        help="steps between automatic rebalances with --eplb [3000]")
    parser.add_argument("--staging-budget-mb", type=int, metavar="MB",
                        help="memory a worker may spend building the target's shard beside the live one before a "
                             "switch; a switch needing more runs in place, inside the freeze [no limit]")
    parser.add_argument("--staging-duty", type=float, metavar="FRACTION",
                        help="share of its time a worker's staging thread may work while serving (it rests the "
                             "rest, piece by piece): below 1, staging takes longer and the steps beside it slow "
                             f"down less [{DEFAULT_STAGING_DUTY}]")


def add_gpu_arguments(parser: argparse.ArgumentParser) -> None:
    """--gpus and --gpu-sharing (also used by `reconfig generate` and `demo`)."""
    parser.add_argument("--gpus", help="--device cuda: a count (2) or CUDA ordinals (0,1; one GPU: 3,); rank i runs "
                                       "on the i-th of them [every visible GPU, one worker each]")
    parser.add_argument("--gpu-sharing", action="store_true", default=None,
                        help="let several workers share a GPU (gloo instead of NCCL; development) [off]")
    parser.add_argument("--enforce-eager", action="store_true", default=None,
                        help="--device cuda: run every step eagerly, no CUDA graphs for decode steps [off]")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="weights, activations and KV cache [auto: float32 on CPU, the checkpoint's on a GPU]")
    parser.add_argument("--numerics", choices=MODES,
                        help="invariant: no bit of a token's result depends on its batch, its prompt's chunking or "
                             "the layout, so a live switch changes no token (slower) [fast]")
    parser.add_argument("--kernels", choices=KERNELS,
                        help="triton: fused RMSNorm + residual, rotary + KV-cache write, paged decode attention "
                             "and SwiGLU kernels (--device cuda; needs the triton package; --enforce-eager turns "
                             "them off) [torch]")
