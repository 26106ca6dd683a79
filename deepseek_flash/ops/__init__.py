"""Operator verbs of ``deepseek-flash``: status, stats, models, load, unload, set, install-units.

The read verbs print the status tree (``/run/deepseek_flash``) and ask the daemon only when there
is no tree; the verbs that change something go through the control socket. None of them starts an
embedded controller: an operator asking about "the daemon" must hear when there is none.
"""
