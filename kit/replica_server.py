"""Chapter 18: N replicas of the engine on Ray Serve, behind the same OpenAI app (05_server.py --replicas N).

Each replica is a Ray Serve deployment replica: one process holding one engine (`load_engine`
with the command's options, its own KV pool and prefix cache). The ingress is the server's own
process: it runs the OpenAI app as without replicas, with `ReplicaEngine` in place of the
engine. That object looks to the app like an engine that schedules itself (Chapter 9): it
tokenises, counts the service's requests for the admission queue (--max-waiting holds for the
whole service) and hands each request to a Ray Serve deployment handle, whose router picks the
replica (kit/replica_router.py, or Ray's power of two choices). Each replica reports its stats
with every answer it finishes; /metrics serves them with a `replica` label.

Ray is imported only here and only when --replicas is given: the default server never loads it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
from pathlib import Path

from kit import cli
from kit.engines import load_object, split_spec
from minivllm.engine_loop import EngineUnavailable

REPO_ROOT = Path(__file__).resolve().parent.parent
APP_NAME = "minivllm"
MAX_REPLICAS = 64
MAX_ONGOING = 256           # requests a replica takes at once; its engine queues what its seats cannot run
ROUTERS = ("prefix", "pow2")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("replicas (Chapter 18, Ray Serve)")
    g.add_argument("--replicas", type=cli.integer(1, MAX_REPLICAS), default=None,
                   help="serve N replicas of the engine on Ray Serve behind this server (default: one engine, no Ray)")
    g.add_argument("--router", choices=ROUTERS, default="prefix",
                   help="prefix: the replica holding the longest prefix of the prompt; pow2: Ray's power of "
                        "two choices (default: prefix)")
    g.add_argument("--route-imbalance", type=cli.integer(0, 10_000), default=4,
                   help="requests a warm replica's queue may exceed the shortest by before the prefix "
                        "router takes the least loaded (default: 4)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. ray://head:10001 or auto); default: start a local Ray")
    g.add_argument("--cpus-per-replica", type=cli.number(above=0, high=1024), default=None,
                   help="each replica's CPUs, and its torch threads (default: the machine's cores over the replicas)")
    g.add_argument("--min-replicas", type=cli.integer(0, MAX_REPLICAS), default=None,
                   help="autoscale: at least this many replicas (with --max-replicas)")
    g.add_argument("--max-replicas", type=cli.integer(1, MAX_REPLICAS), default=None,
                   help="autoscale: at most this many replicas, on queue length")
    g.add_argument("--target-ongoing-requests", type=cli.number(above=0, high=10_000), default=8,
                   help="autoscale: requests per replica Ray aims for (default: 8)")


# --8<-- [start:deploy]
def deployment_options(args: argparse.Namespace, gpu: bool = False) -> dict:
    """The options of `serve.deployment` for the command's flags (ValueError for a bad mix)."""
    autoscale = args.min_replicas is not None or args.max_replicas is not None
    if autoscale and (args.min_replicas is None or args.max_replicas is None):
        raise ValueError("--min-replicas and --max-replicas go together")
    if autoscale and args.min_replicas > args.max_replicas:
        raise ValueError(f"--min-replicas {args.min_replicas} is more than --max-replicas {args.max_replicas}")
    n = args.replicas
    cpus = args.cpus_per_replica or max(1.0, (os.cpu_count() or 1) // max(1, args.max_replicas or n))
    actor = {"num_cpus": cpus, "runtime_env": {"env_vars": {"PYTHONPATH": str(REPO_ROOT),
                                                            "OMP_NUM_THREADS": str(max(1, int(cpus)))}}}
    if gpu:
        actor["num_gpus"] = 1
    options = {"name": "engine", "ray_actor_options": actor, "max_ongoing_requests": MAX_ONGOING}
    if autoscale:   # Ray adds or removes replicas to keep each one's queue near the target
        options["autoscaling_config"] = {"min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
                                         "initial_replicas": min(max(n, args.min_replicas), args.max_replicas),
                                         "target_ongoing_requests": args.target_ongoing_requests}
    else:
        options["num_replicas"] = n
    if args.router == "prefix":
        from ray.serve.config import RequestRouterConfig
        options["request_router_config"] = RequestRouterConfig(
            request_router_class="kit.replica_router:PrefixRequestRouter",
            request_router_kwargs={"imbalance": args.route_imbalance})
    return options
# --8<-- [end:deploy]


class EngineReplica:
    """One replica: an engine and its stream of answers (made a Ray Serve deployment by `start`)."""

    def __init__(self, spec: str, model: str | None, device: str | None, options: dict, lora_modules: list[str]):
        from ray import serve

        from kit import adapter_routes
        from kit.engines import load_engine
        self.engine = load_engine(spec, model, device=device, **options)
        adapter_routes.add_lora_modules(self.engine, lora_modules)   # every replica serves the same adapters
        if not self.engine.capabilities().schedules_itself:
            raise ValueError(f"--replicas serves an engine that schedules itself (minivllm:LLM), not {spec}")
        self.name = serve.get_replica_context().replica_id.unique_id

    def info(self) -> dict:
        """What the ingress needs once: the tokenizer, the capabilities, features and adapters."""
        loras = self.engine.list_loras() if self.engine.capabilities().serves_adapters else []
        return {"tokenizer": self.engine.tokenizer, "capabilities": self.engine.capabilities(),
                "features": self.engine.features(), "loras": loras, "stats": self.report()}

    def report(self) -> dict:
        stats = {k: v for k, v in self.engine.stats().items() if isinstance(v, (int, float))}
        blocks = getattr(self.engine, "blocks", None)   # the prefix cache's totals, in prompt tokens
        if blocks is not None and hasattr(blocks, "hit_tokens"):
            stats.update(prefix_cache_queries=blocks.prompt_tokens, prefix_cache_hits=blocks.hit_tokens)
        return {"replica": self.name, **stats}

    # --8<-- [start:replica]
    async def generate(self, job: dict):
        """Text pieces, this replica's counters, then the GenerateResult; cancelled, the request is aborted."""
        adapter = {"lora_request": job["lora"]} if job.get("lora") is not None else {}
        request = self.engine.new_request(job["ids"], job["max_tokens"], job["params"], **adapter)
        [stream] = self.engine.submit_all([request])
        try:
            while (item := await asyncio.to_thread(next, stream, None)) is not None:
                if not isinstance(item, str):   # the counters first: a reader may stop at the result
                    yield self.report()
                yield item
        finally:
            stream.close()
    # --8<-- [end:replica]


class RoutedJob:
    """A request as the app holds it before the handle routes it (`new_ids` counts what came back)."""

    def __init__(self, ids: list[int], max_tokens: int, params, lora):
        self.ids, self.max_tokens, self.params, self.lora, self.new_ids = ids, max_tokens, params, lora, []

    def payload(self) -> dict:   # what the router reads: ids, salt and adapter
        return {"ids": self.ids, "max_tokens": self.max_tokens, "params": self.params, "lora": self.lora,
                "salt": self.params.cache_salt if self.params is not None else None,
                "adapter": self.lora.lora_name if self.lora is not None else None}


class ReplicaEngine:
    """The ingress's engine: requests go to the replicas through a Ray Serve handle."""

    def __init__(self, handle, started_ray: bool):
        self.handle, self.started_ray = handle, started_ray
        info = handle.info.remote().result(timeout_s=600)
        self.tokenizer, self.can, self._features = info["tokenizer"], info["capabilities"], info["features"]
        self.loras = info["loras"]
        self.replicas: dict[str, dict] = {info["stats"]["replica"]: info["stats"]}
        self.in_flight, self._lock = 0, threading.Lock()
        self.seats = (self.can.max_num_seqs or 1) * handle_replicas(handle)

    def capabilities(self):
        return self.can.replace(max_num_seqs=self.seats)   # the service's seats: every replica's

    def list_loras(self):
        return self.loras

    def features(self) -> dict:
        return {**self._features, "replicas": len(self.replicas)}

    def stats(self) -> dict:
        """The service's load (counted here, for the admission queue) and each replica's last report."""
        running = min(self.in_flight, self.seats)
        return {"running": running, "waiting": self.in_flight - running, "replicas": dict(self.replicas)}

    def unavailable(self) -> str | None:
        return None   # Ray Serve restarts a replica that dies: the service stands while the handle does

    def snapshot(self):
        return None   # the scheduler's picture is per replica: /engine/scheduler shows none

    def new_request(self, ids: list[int], max_tokens: int, params, lora_request=None) -> RoutedJob:
        return RoutedJob(list(ids), max_tokens, params, lora_request)

    def close(self) -> None:
        """Stop the replicas and, where this server started it, the local Ray with every process of it."""
        import ray
        from ray import serve
        try:
            serve.delete(APP_NAME)
            if self.started_ray:
                serve.shutdown()
        finally:
            ray.shutdown()

    # --8<-- [start:ingress]
    def submit_all(self, jobs: list[RoutedJob]) -> list:
        with self._lock:
            self.in_flight += len(jobs)
        return [RoutedStream(self, job, self.handle.options(stream=True).generate.remote(job.payload()))
                for job in jobs]


class RoutedStream:
    """One answer from a replica: text pieces then the GenerateResult, as Chapter 9's RequestStream.
    close(), from any thread and any number of times, cancels the call (the replica aborts the
    request) and gives the service's seat back."""

    def __init__(self, engine: ReplicaEngine, job: RoutedJob, response):
        self.engine, self.job, self.response, self.closed = engine, job, response, False
        self._items = self._read()

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._items)

    def _read(self):
        from ray.exceptions import RayError, RayTaskError
        try:
            for item in self.response:
                if isinstance(item, dict):   # the replica's counters, sent with its answer
                    self.engine.replicas[item["replica"]] = item
                    continue
                if isinstance(item, str):
                    self.job.new_ids.append(item)
                yield item
        except RayTaskError as exc:   # the replica refused the request: its own error, not Ray's wrapper
            if isinstance(exc.cause, ValueError):
                raise exc.cause from None
            raise EngineUnavailable(f"a replica failed: {type(exc.cause).__name__}: {exc.cause}") from None
        except RayError as exc:       # the replica died mid-answer
            raise EngineUnavailable(f"a replica failed: {type(exc).__name__}") from None
        finally:
            self.close()

    def close(self) -> None:
        with self.engine._lock:
            if self.closed:
                return
            self.closed = True
            self.engine.in_flight -= 1
        self.response.cancel()
    # --8<-- [end:ingress]


def handle_replicas(handle) -> int:
    from ray import serve
    status = serve.status().applications[APP_NAME].deployments["engine"]
    return max(1, sum(status.replica_states.values()))


# --8<-- [start:start]
def start(args: argparse.Namespace, engine_options: dict) -> ReplicaEngine:
    """Start (or join) Ray, deploy the replicas and return the ingress's engine."""
    engine_class = load_object(split_spec(args.engine)[0], "Class")
    if not hasattr(engine_class, "submit_all"):   # before Ray starts: a replica must batch its requests
        raise ValueError(f"--replicas serves an engine that schedules itself (--engine minivllm:LLM), not {args.engine}")
    import ray
    import torch
    from ray import serve
    options = deployment_options(args, gpu=torch.cuda.is_available() and args.device != "cpu")
    engine_options = {**engine_options, "threads": max(1, int(options["ray_actor_options"]["num_cpus"]))}
    started = not ray.is_initialized() and args.ray_address is None
    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}}, ignore_reinit_error=True)
    serve.start(http_options={"location": "NoServer"})
    app = serve.deployment(EngineReplica, **options).bind(args.engine, args.model, args.device,
                                                              engine_options, args.lora_modules)
    handle = serve.run(app, name=APP_NAME, route_prefix=None)
    return ReplicaEngine(handle, started)
# --8<-- [end:start]
