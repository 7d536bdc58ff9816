"""The OpenAI-compatible HTTP server (`spindle serve`): api_server.py builds the app
and runs it; protocol.py holds the request bodies and the error shape; the
serving_*.py modules answer completions and chat; metrics.py exports Prometheus
metrics; dev_routes.py holds the control routes mounted only in dev mode."""
