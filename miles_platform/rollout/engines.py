"""Start the rollout side of a run: engines (embedded Ray actors, SGLang, or external) + the router."""

from __future__ import annotations

from miles_platform.config import RunConfig
from miles_platform.weights.transports import EngineHandle


def start_engines(cfg: RunConfig):
    """-> (engine handles, router handle with .url/.stop()). Engines start at weight version 0."""
    from miles_platform.rollout.router import start_router

    handles: list[EngineHandle] = []
    if cfg.rollout_external_engine_addrs:
        from miles_platform.rollout.sglang_launcher import attach_external_engines

        handles = [EngineHandle(url=u) for u in attach_external_engines(cfg)]
    elif cfg.rollout_engine == "sglang":
        from miles_platform.rollout.sglang_launcher import launch_sglang_engines

        handles = [EngineHandle(url=u, actor=a) for u, a in launch_sglang_engines(cfg)]
    else:
        import ray

        from miles_platform.rollout.engine import make_engine_actor

        n = max(1, (cfg.rollout_num_gpus or 1) // cfg.rollout_num_gpus_per_engine)
        cls = make_engine_actor(num_cpus=cfg.num_cpus_per_actor)
        env = {"env_vars": {"OMP_NUM_THREADS": "1"}}
        actors = [
            cls.options(runtime_env=env).remote(
                cfg.hf_checkpoint, api_key=cfg.api_key, dtype=cfg.rollout_dtype
            )
            for _ in range(n)
        ]
        urls = ray.get([a.url.remote() for a in actors])
        handles = [EngineHandle(url=u, actor=a) for u, a in zip(urls, actors, strict=True)]
    router = start_router(
        port=cfg.sglang_router_port or 0, api_key=cfg.api_key, worker_urls=[h.url for h in handles]
    )
    return handles, router


def stop_engines(handles: list[EngineHandle]) -> None:
    import ray

    for h in handles:
        if h.actor is not None:
            try:
                ray.get(h.actor.shutdown.remote(), timeout=30)
            except Exception:  # the actor may already be gone; killing it below is what matters
                pass
            ray.kill(h.actor)
