"""The OpenAI API over engine clients, as plain classes: protocol, serving per endpoint, the request path by stage, parsers, output formatting, the error table.

Nothing here imports Ray Serve or the application (`serve_app`): the ingress deployment
(`deployments/ingress.py`) wires `OpenAIServer` to HTTP, and to the engines through the router
(`mmserve.transit.router`).
"""
