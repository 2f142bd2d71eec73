"""``growpage serve``: an OpenAI-compatible HTTP server over the engine (a face: it imports the
engine, nothing inside the library imports it).

``app`` (routes, FastAPI), ``protocol`` (request and response bodies), ``engine_loop`` (the
thread that owns the engine), ``metrics`` (Prometheus), ``cli`` (the subcommand). Needs the
``serve`` extra (``pip install 'growpage[serve]'``): fastapi, uvicorn, prometheus-client,
imported only when the server is built, so this package imports without them.

::

    from growpage import LLM
    from growpage.server.app import ServerConfig, create_app

    app = create_app(LLM(), ServerConfig(model_name="SmolLM2-135M-Instruct"))
    # uvicorn.run(app), or `growpage serve`
"""
