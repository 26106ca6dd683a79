"""Client side: talk to the controller (daemon socket or embedded) and build models on its memory."""
