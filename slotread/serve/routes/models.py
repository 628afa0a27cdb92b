"""``GET /v1/models``: the served model and its ``jev-latest`` alias, in System One's listing shape."""

from __future__ import annotations

import datetime
from pathlib import Path

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


class ModelList(BaseModel):
    """Every model a request may name."""

    models: list[ModelInfo]


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
    return ModelList(models=[served, *aliases])
