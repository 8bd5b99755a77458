"""The service: Ray Serve deployments around the engine and the controller, behind gRPC.

Modules: ``config`` (the pydantic ServiceConfig, Serve config writer), ``app``
(``build_app``, embedded start/stop), ``ingress`` (gRPC servicer), ``target``
(TargetEngine replicas), ``loop`` (the engine's thread and its callers, Ray-free),
``engine_proc`` (the same in an engine process of its own: the replicas' default),
``controller`` (the Controller singleton, its Ray-free core), ``faults`` (drafter
guards), ``metrics``, ``convert`` (proto <-> internal), ``client``, ``cli``.
Importing this package imports neither Ray nor torch.
"""
