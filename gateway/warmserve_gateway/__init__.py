"""warmserve's gateway: one OpenAI-compatible endpoint for every ModelDeployment.

It routes each request by its ``model`` to a serving instance (least outstanding requests, never
an instance in grace), holds requests in a per-model FIFO queue while no instance has room (the
cold start of a model scaled to zero, or a burst), and reports the requests it holds so the
operator counts them as demand (scale from zero).  ``docs/gateway.md`` describes the design.

Layout (layers top-down; import-linter keeps them):

* :mod:`.cli` — ``warmserve gateway``: the flags (defaults from :mod:`.config`) and the handler;
* :mod:`.server` — the aiohttp applications (public API, admin port) and request handling;
* :mod:`.proxy` — forwarding to an engine, streaming the answer back, retry before the first byte;
* :mod:`.discovery` — ModelDeployments from the Kubernetes API (watch) or a static file;
* :mod:`.holding` — per-model queues and caps, dispatch to instances with room;
* :mod:`.demand` — the held counts each replica reports to the operator (``/demand``);
* :mod:`.catalog`, :mod:`.routing`, :mod:`.auth`, :mod:`.errors`, :mod:`.metrics`, :mod:`.config`
  — pure pieces: deployments as routes, the routing rule, API keys, error shapes, metrics.

The gateway never decides to start an instance: it only reports demand; the operator's
autoscaler (:mod:`warmserve.policy.autoscaler`) decides.
"""
