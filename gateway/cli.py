"""The ``vllm-gateway`` command: serve, check, sim."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gateway import __version__
from gateway.config import CONFIG_ENV, Config, ConfigError, load
from gateway.errors import EXIT_CONFIG
from gateway.observability import logs

if TYPE_CHECKING:  # argparse has no public name for it, and it is generic only in typeshed
    from gateway.control.process import Plane

    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

log = logging.getLogger("gateway")
LISTEN_ENV = "VGW_GATEWAY__LISTEN"


def _load_or_exit(path: str, listen: str | None = None) -> tuple[Config, str | None]:
    """The config with the environment's overrides, and the file's text it was read from;
    ``--listen`` is one more override, on top, which the serving processes inherit (as
    ``VGW_GATEWAY__LISTEN``)."""
    if listen is not None:
        os.environ[LISTEN_ENV] = listen
    try:
        text: str | None = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        text = None  # load says why
    try:
        return load(path, text=text), text
    except ConfigError as exc:
        for problem in exc.problems:
            if listen is not None and problem.startswith(LISTEN_ENV + ":"):
                problem = "--listen" + problem.removeprefix(LISTEN_ENV)
            print(problem, file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway import workers
    from gateway.control import process
    from gateway.errors import StreamAborted
    from gateway.http.server import DescriptorLimit, connection_cap

    config, text = _load_or_exit(args.config, args.listen)
    logs.setup(config.gateway.log_level, StreamAborted, fmt=config.gateway.log_format)
    if not config.gateway.api_keys and not config.keys:
        log.warning("no [[keys]] or [gateway] api_keys configured: the gateway is open to "
                    "any client")
    if config.gateway.admin_key is None:
        log.warning("no [gateway] admin_key: the admin API answers loopback clients only")
    try:  # the soft limit is raised here, for the workers and backends to inherit
        connection_cap(config.gateway.max_connections)
    except DescriptorLimit as exc:
        log.error("cannot serve: %s", exc)
        return 1
    path = str(Path(args.config).resolve())
    processes = config.gateway.processes
    if processes > 1:
        return process.serve(config, path, processes, _control_plane(config, path, text))
    os.environ[CONFIG_ENV] = path  # the app factory reads the config from this path
    uvicorn.run("gateway.app:from_env", factory=True, host=config.gateway.host,
                port=config.gateway.port, **workers.uvicorn_options(config.gateway))
    return 0


def _control_plane(config: Config, path: str, text: str | None) -> Plane:
    """What the control process runs, built as every process's parts are; its workers
    are told the file's text it runs (``text``), even one started after an edit that was
    never reloaded."""
    from gateway.build import build
    from gateway.control.process import Plane
    from gateway.control.role import Kind, Role
    from gateway.lifespan import Lifespan

    parts = build(config, path, Role(Kind.CONTROL))
    assert parts.workers is not None
    parts.workers.publish(0, text)
    operators, shared = parts.operators, parts.shared

    def redis_url() -> str | None:
        embedded = shared.embedded if shared is not None else None
        return embedded.url if embedded is not None else None

    return Plane(parts.workers, [*operators.admin.routes(), *operators.canary.routes()],
                 lambda: Lifespan(parts, config)(None), redis_url,
                 getattr(parts.kv, "directory", None))


def _check(args: argparse.Namespace) -> int:
    config, _ = _load_or_exit(args.config)
    print(f"{args.config}: OK ({len(config.backends)} backends)")
    if config.routing.policy == "kv":  # which backends the kv policy sees exactly
        for spec in config.backends:
            how = ("exact: its KV events" if spec.kv_endpoints is not None else
                   "estimated: no KV events (kv_events), routed by what the gateway sent it")
            print(f"  {spec.name}: {how}")
    return 0


def _sim(args: argparse.Namespace) -> int:
    import uvicorn

    from backends.sim import SimApp, SimOptions
    from backends.sim.app import SimulatedCrash
    from backends.sim.options import Fault

    try:
        models = [SimOptions.parse_model(m) for m in args.model or ["sim-model"]]
    except ValueError as exc:
        print(f"--model: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    options = SimOptions(
        models=tuple(name for name, _ in models),
        model_overrides=tuple((name, o) for name, o in models if o),
        ttft=args.ttft,
        itl=args.itl,
        tokens=args.tokens,
        max_prompt_len=args.max_prompt_len,
        error_rate=args.error_rate,
        busy_rate=args.busy_rate,
        retry_after=args.retry_after,
        fault=Fault(args.fault),
        after=args.after,
        split=args.split,
        stall=args.stall,
        seed=args.seed,
        capacity=args.capacity,
        kv_events=args.kv_events, kv_replay=args.kv_replay, kv_block=args.kv_block,
        kv_blocks=args.kv_blocks, kv_drop=args.kv_drop, token_details=args.token_details,
        prefill_rate=args.prefill_rate, dev_mode=os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
        sleep_mode=args.enable_sleep_mode, wake_delay=args.wake_delay,
        wake_garbles=args.wake_garbles, enable_lora=args.enable_lora, max_loras=args.max_loras,
        runtime_lora=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower()
        in ("1", "true"), lora_delay=args.lora_load_delay,
    )
    logs.setup(args.log_level, SimulatedCrash, fmt="text")
    uvicorn.run(
        SimApp(options), host=args.host, port=args.port, loop="uvloop", http="httptools",
        access_log=False, log_config=None, backlog=4096, timeout_keep_alive=75,
    )
    return 0


def _admin(args: argparse.Namespace) -> int:
    from gateway.admin import client as admin_cli

    target = admin_cli.Target.of(args, lambda: _load_or_exit(args.config)[0])
    if args.command == "status":
        return admin_cli.status(target, args)
    if args.command == "drain":
        return admin_cli.drain(target, args)
    if args.command == "canary":
        return admin_cli.canary(target, args)
    if args.command == "reload":
        return admin_cli.reload(target, args)
    return admin_cli.act(target, args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-gateway",
        description="A streaming, load-balancing OpenAI gateway in front of vLLM backends.",
    )
    parser.add_argument("--version", action="version", version=f"vllm-gateway {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    config = argparse.ArgumentParser(add_help=False)
    config.add_argument("--config", default="config.toml",
                        help="default: ./config.toml; any key can be set over it from the "
                             "environment as VGW_SECTION__KEY (e.g. VGW_REDIS__URL)")
    serve = sub.add_parser("serve", parents=[config], help="run the gateway")
    serve.add_argument("--listen", metavar="HOST:PORT",
                       help="over [gateway] listen and VGW_GATEWAY__LISTEN")
    serve.set_defaults(func=_serve)
    sub.add_parser("check", parents=[config],
                   help="validate the config; exit 2 listing every problem"
                   ).set_defaults(func=_check)
    _admin_commands(sub, config)
    _sim_command(sub)
    return parser


def _admin_commands(sub: Subparsers, config: argparse.ArgumentParser) -> None:
    """The verbs that talk to a running gateway's admin API."""
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument("--url", help="a gateway's base URL (or VGW_ADMIN_URL); default: "
                        "[gateway] listen of --config")
    remote.add_argument("--admin-key", help="(or VGW_ADMIN_KEY, which keeps it out of the "
                        "process list); default: [gateway] admin_key of --config")

    def verb(name: str, text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[config, remote], help=text)
        p.set_defaults(func=_admin)
        return p

    verb("status", "print every backend's state (admin API)").add_argument(
        "--json", action="store_true")
    drain = verb("drain", "stop new requests to a backend, wait for in-flight")
    drain.add_argument("backend")
    drain.add_argument("--then", choices=["none", "restart", "stop"], default="none")
    drain.add_argument("--timeout", type=float, help="seconds to wait for in-flight requests")
    for name, text in (("restart", "restart a spawned backend (also after 'failed')"),
                       ("stop", "stop a spawned backend"),
                       ("start", "start a stopped backend"),
                       ("sleep", "drain a spawned backend and put it to sleep (sleep mode)"),
                       ("wake", "wake a sleeping backend and check its answers")):
        verb(name, text).add_argument("backend")
    verb("rolling-restart", "drain and restart every spawned backend, one at a time")
    canary = verb("canary", "the canary rollout: status, set, promote, rollback, pause, resume")
    canary.add_argument("action", choices=["status", "set", "promote", "rollback", "pause",
                                           "resume"])
    canary.add_argument("group", nargs="?", help="set: the group whose weight is given")
    canary.add_argument("weight", nargs="?", type=float, help="set: percentage 0-100")
    canary.add_argument("--why", default="", help="recorded with the change")
    canary.add_argument("--json", action="store_true")
    verb("reload", "re-read the config file in the running gateway")


def _sim_command(sub: Subparsers) -> None:
    sim = sub.add_parser("sim", help="run the vLLM simulator")
    sim.add_argument("--port", type=int, required=True)
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--model", action="append",
                     help="served model name, repeatable; NAME:itl=0.2,tokens=8 gives that "
                          "model its own options (x-sim syntax)")
    sim.add_argument("--ttft", type=float, default=0.0, help="seconds to the first token")
    sim.add_argument("--prefill-rate", type=float, default=0.0,
                     help="uncached prompt tokens prefilled a second, one prompt after "
                          "another (added to --ttft); 0 = no prefill time")
    sim.add_argument("--itl", type=float, default=0.0, help="seconds between tokens")
    sim.add_argument("--tokens", type=int, default=16, help="output tokens without max_tokens")
    sim.add_argument("--max-prompt-len", type=int, default=0, help="400 above this; 0 = off")
    sim.add_argument("--error-rate", type=float, default=0.0, help="fraction answered 500")
    sim.add_argument("--busy-rate", type=float, default=0.0, help="fraction answered 503")
    sim.add_argument("--retry-after", type=int, default=1, help="Retry-After of a 503, seconds")
    sim.add_argument("--fault", default="none",
                     choices=["none", "500", "busy", "crash", "inband", "stall", "cut"],
                     help="a fault applied to every request (x-sim header: per request)")
    sim.add_argument("--after", type=int, default=0,
                     help="chunks before crash/inband/stall; body bytes before cut")
    sim.add_argument("--split", type=int, default=0,
                     help="bytes per write of a reply body or SSE event; 0 = one write each")
    sim.add_argument("--stall", type=float, default=3600.0, help="seconds a stall lasts")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--capacity", type=int, default=0,
                     help="requests generated at once; more wait in its queue (0 = no limit)")
    sim.add_argument("--kv-events", default="", help="ZMQ endpoint to publish vLLM's KV "
                     "events on (bound), e.g. ipc:///tmp/sim.pub; off by default")
    sim.add_argument("--kv-replay", default="", help="ZMQ endpoint answering replays")
    sim.add_argument("--kv-block", type=int, default=16, help="prefix-cache block, tokens")
    sim.add_argument("--kv-blocks", type=int, default=200_000, help="blocks the cache holds")
    sim.add_argument("--kv-drop", type=int, default=0,
                     help="lose every Nth event batch on the way (kept for replays)")
    sim.add_argument("--token-details", action="store_true",
                     help="cached tokens in each reply's usage (vLLM's "
                          "--enable-prompt-tokens-details)")
    sim.add_argument("--enable-sleep-mode", action="store_true",
                     help="vLLM's sleep mode; its routes need VLLM_SERVER_DEV_MODE=1")
    sim.add_argument("--wake-delay", type=float, default=0.0, help="seconds a wake takes")
    sim.add_argument("--wake-garbles", action="store_true",
                     help="a fault: wrong answers after every wake")
    sim.add_argument("--enable-lora", action="store_true", help="LoRA adapters (loaded "
                     "at runtime with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)")
    sim.add_argument("--max-loras", type=int, default=1, help="adapters in one batch")
    sim.add_argument("--lora-load-delay", type=float, default=0.0,
                     help="seconds an adapter's load takes")
    sim.add_argument("--log-level", default="warning")
    sim.set_defaults(func=_sim)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
