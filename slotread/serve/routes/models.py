"""``GET /v1/models``: the served model and its ``jev-latest`` alias, in System One's listing shape
(``models``) and, on the same body, OpenAI's (``object: "list"``, ``data``), which the ``openai`` client
reads (``client.models.list()`` found nothing in a System One-only body)."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel

from slotread.decider import MODEL_ALIASES
from slotread.models.registry import REGISTRY
from slotread.serve.deps import Authorized, ServiceDep

router = APIRouter(dependencies=[Authorized], tags=["models"])


class ModelInfo(BaseModel):
    """One model a request may name."""

    name: str
    description: str
    release_date: str
    #: whether requests to it may carry images (a vision tower read in process)
    x_images: bool = False


class OpenAIModel(BaseModel):
    """One model as OpenAI lists it."""

    id: str
    object: Literal["model"] = "model"
    #: the release date (midnight UTC) as a Unix time
    created: int
    owned_by: str = "slotread"


class ModelList(BaseModel):
    """Every model a request may name, in both listing shapes."""

    models: list[ModelInfo]
    object: Literal["list"] = "list"
    data: list[OpenAIModel]


def describe(name: str) -> ModelInfo:
    """A registry model's own description and release date; a local checkpoint's path and file date."""
    if name in REGISTRY:
        entry = REGISTRY[name]
        return ModelInfo(name=name, description=entry.description, release_date=entry.release_date)
    path = Path(name)
    day = datetime.date.fromtimestamp(path.stat().st_mtime) if path.exists() else datetime.date.today()
    return ModelInfo(name=name, description=f"local checkpoint {name}", release_date=day.isoformat())


@router.get("/v1/models", summary="List the models a request may name")
async def list_models(service: ServiceDep) -> ModelList:
    """The served model, then its aliases (``jev-latest``); ``x_images`` says whether they take images."""
    decider = service.ready_decider()
    served = describe(decider.name).model_copy(update={"x_images": decider.takes_images})
    aliases = [
        ModelInfo(
            name=alias,
            description=f"alias of {served.name}",
            release_date=served.release_date,
            x_images=served.x_images,
        )
        for alias in MODEL_ALIASES
    ]
    models = [served, *aliases]
    return ModelList(models=models, data=[_openai(model) for model in models])


def _openai(model: ModelInfo) -> OpenAIModel:
    released = datetime.datetime.fromisoformat(model.release_date).replace(tzinfo=datetime.UTC)
    return OpenAIModel(id=model.name, created=int(released.timestamp()))
