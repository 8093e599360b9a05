"""``specdec serve``: an OpenAI-compatible server with continuous batching and a live page of speculation.

- ``config``: ``ServeConfig``, the server's own settings (host, port, API key, body limit);
- ``engine``: one ``Decoder`` on a worker thread; requests join the running batch at round boundaries;
- ``protocol``: OpenAI's request bodies, their checks, error objects, chat prompts;
- ``text``: incremental detokenizing with OpenAI's stop-string rule;
- ``metrics``: Prometheus metrics named as vLLM's;
- ``app``: the FastAPI app (endpoints, streaming, the API key, the page in ``static/``);
- ``policy``: the Host, Origin and Content-Type checks a browser's foreign page meets;
- ``server``: building the app from the configs, running it on a thread;
- ``cli``: the ``specdec serve`` subcommand.

Only ``config`` and ``cli`` import without the ``serve`` extra (FastAPI, uvicorn, prometheus_client).
"""

from specdec.serve.config import ServeConfig

__all__ = ["ServeConfig"]
