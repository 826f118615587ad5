"""How requests enter: the HTTP server's lifecycle (shutdown, watchdog, connection limits) and
its APIs."""
