"""``deepseek-flash serve``: an OpenAI-compatible HTTP server over a model the controller serves.

* ``scheduler`` -- the L0/L1/L2 policy (``FlashScheduler``, ``route``), pure and table-tested;
* ``engine`` -- continuous batching over a ``load_model`` model: requests join and leave the
  running batch at step boundaries; ``runner`` -- its forwards over one shared KV cache with a row
  per request, and sampling; ``generation`` -- one request's state, tokens to text;
* ``app`` -- the FastAPI application (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
  ``/healthz``, ``/metrics``) and the ``serve`` verb.
"""
from .scheduler import FlashScheduler, FifoScheduler, Route, SchedRequest

__all__ = ["FlashScheduler", "FifoScheduler", "Route", "SchedRequest"]
