"""The controller: block manager, prefetch engine, GPU fabric, recovery, socket server.

Built by one composition root (``daemon.app.Application``) and run either as ``deepseek-flashd``
or embedded in a client process.
"""
