"""``GET /v1/models`` and ``GET /v1/models/{model}``: the base models and the LoRA adapters a
key may call (:mod:`gateway.adapters`, over :mod:`gateway.model_registry`)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse

from api import responses
from api.views import api_view, authenticate
from gateway.adapters import Target, callable_targets, resolve_target


def _object(target: Target) -> dict:
    return responses.model_object(target.name, target.created, owned_by=target.owned_by,
                                  parent=target.model.name if target.entry else None)


@api_view("GET")
async def list_models(request: HttpRequest) -> HttpResponse:
    """``GET /v1/models``: the models served that the key may call (the default model first,
    then by name), then the adapters it may call (``base:adapter``, by name; ``owned_by`` its
    tenant's slug, or ``system`` for a shared one; ``parent``: its base model)."""
    targets = await callable_targets(await authenticate(request))
    return JsonResponse({"object": "list", "data": [_object(t) for t in targets]})


@api_view("GET")
async def retrieve_model(request: HttpRequest, model: str) -> HttpResponse:
    """``GET /v1/models/{model}`` (a base model or ``base:adapter``): 404 ``model_not_found``
    alike for a model not served and one the key may not call."""
    return JsonResponse(_object(await resolve_target(await authenticate(request), model)))
