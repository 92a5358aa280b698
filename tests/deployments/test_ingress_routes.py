"""The ingress routes receive the request object whatever FastAPI version is installed.

`@serve.ingress` hands its replicas a cloudpickled copy of the FastAPI app. The route functions
travel by value and keep only the globals their code names, so a string annotation (what
`from __future__ import annotations` makes of `request: Request`) cannot be resolved in the
replica. FastAPI >= 0.137 builds its routes lazily (at the first request, in the replica) and then
treats `request` as a required query parameter: 422 on every route. These tests look at the app
exactly as a replica gets it.
"""

import inspect

from fastapi.dependencies.utils import get_typed_signature
from ray import cloudpickle
from ray.serve._private.http_util import _walk_fastapi_routes
from starlette.requests import Request

import deployments.ingress as ingress_module
from deployments.ingress import Ingress, api

ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/metrics", "/health"}


def replica_copy_of_app():
    """What `@serve.ingress` gives each replica: `cloudpickle.loads(dumps(app))`."""
    return cloudpickle.loads(cloudpickle.dumps(api))


def test_no_string_annotations_in_the_ingress_module():
    functions = [f for _, f in inspect.getmembers(ingress_module, inspect.isfunction) if f.__module__ == ingress_module.__name__]
    functions += [f for _, f in inspect.getmembers(Ingress.func_or_class, inspect.isfunction)]
    assert len(functions) > 10
    stringly = {
        f.__qualname__: name
        for f in functions
        for name, annotation in inspect.get_annotations(f).items()
        if isinstance(annotation, str)
    }
    assert stringly == {}, f"string annotations (remove `from __future__ import annotations`): {stringly}"


def test_replica_copy_of_app_resolves_request_parameters():
    routes = {route.path: route for route, _, _ in _walk_fastapi_routes(replica_copy_of_app())}
    assert ROUTES <= set(routes)
    for path in ROUTES:
        signature = get_typed_signature(routes[path].endpoint)
        for name, parameter in signature.parameters.items():
            if name == "request":
                assert parameter.annotation is Request, (path, parameter.annotation)


def test_replica_copy_of_app_declares_no_query_parameters():
    # OpenAPI is built from the same lazily analysed routes that serve requests.
    spec = replica_copy_of_app().openapi()
    assert ROUTES <= set(spec["paths"])
    parameters = {
        (path, method, p["name"]): p["in"]
        for path, operations in spec["paths"].items()
        for method, operation in operations.items()
        for p in operation.get("parameters", [])
    }
    assert parameters == {}
